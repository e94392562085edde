"""Write a random-weight GGUF of a family (Llama, Qwen3, Gemma 2 or Qwen3-MoE) for serving benchmarks.

The counterpart of ``shared/peers/make_big_gguf.py`` (a dense Llama-3.2-1B-shaped file) for the
families of issue 33, so raylm and llama-server can be compared on the same file: the metadata
and tensor names llama.cpp's converter writes for that architecture (Qwen3: q/k norms and an
independent head size; Gemma 2: sandwich norms stored as ``1 + w``, soft-caps, a window on every
other layer, a tied head) and the tokenizer of a source GGUF (default: the bundled SmolLM2's).
The default shapes match the Llama file's matmuls (hidden 2048, 16 layers, MLP 8192, 2048-wide
queries and 1024-wide keys / values), so the two families' figures compare with its Llama ones.
Qwen3-MoE (issue 34) is Qwen3's attention with a mixture of experts in every layer: ``--experts 8``
of ``--ffn`` (default 1024) each, ``--top-k 2`` routed per token (renormalized, as llama.cpp does
for qwen3moe), the router kept F32 as llama-quantize keeps it: 1.1B parameters, 0.5B of them
active per token at the defaults. Outputs are noise: benchmarks use ``ignore_eos``.

    python -m raylm.benchmarks.make_family_gguf OUT.gguf [--arch qwen3|gemma2|qwen3moe] [--type Q4_1]
        [--src SRC.gguf] [--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --head-dim 128]
        [--experts 8 --top-k 2]

``--type`` is the matrices' GGUF type (F32, F16, Q8_0, Q4_0, Q4_1; norms stay F32 as
llama-quantize keeps them). ``--arch llama`` writes Llama 3's layout (``--untied``: an output
matrix of its own, as Llama-3.1-8B has); benchmarks/make_test_ggufs.py sizes it like the models
people download and quantizes it with llama-quantize.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from raylm.model.loaders.gguf_file import GGUFReader

# Per family: (default heads, KV heads, head size) giving the Llama file's matmul shapes.
DEFAULT_HEADS = {"llama": (16, 8, 128), "qwen3": (16, 8, 128), "gemma2": (8, 4, 256), "qwen3moe": (16, 8, 128)}
DEFAULT_FFN = {"llama": 8192, "qwen3": 8192, "gemma2": 8192, "qwen3moe": 1024}  # qwen3moe: each expert's
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)


def write_family_gguf(
    out: Path, src: Path, arch: str = "qwen3", kind: str = "Q4_1", layers: int = 16, hidden: int = 2048,
    ffn: int | None = None, heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
    seed: int = 0, experts: int = 8, top_k: int = 2, untied: bool = False,
) -> Path:
    """Write the file; returns ``out``. ``ffn`` / ``heads`` / ``kv_heads`` / ``head_dim`` default
    per family; ``experts`` / ``top_k``: qwen3moe's; ``untied``: an output matrix of its own."""
    defaults = DEFAULT_HEADS[arch]
    ffn = ffn or DEFAULT_FFN[arch]
    heads, kv_heads, head_dim = heads or defaults[0], kv_heads or defaults[1], head_dim or defaults[2]
    qtype = GGMLQuantizationType[kind]
    writer = GGUFWriter(str(out), arch, use_temp_file=True)
    writer.add_name(f"raylm-random-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_rope_freq_base(1_000_000.0)
    elif arch == "llama":
        writer.add_rope_freq_base(500_000.0)
        writer.add_rope_dimension_count(head_dim)
    else:  # Gemma2Model writes no RoPE base (llama.cpp's 10000) and these three
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
        writer.add_sliding_window(4096)
    if arch == "qwen3moe":
        writer.add_expert_count(experts)
        writer.add_expert_used_count(top_k)
        writer.add_expert_feed_forward_length(ffn)
    vocab = _copy_tokenizer(writer, GGUFReader(str(src)))
    if arch == "llama":
        writer.add_vocab_size(vocab)

    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, stack: tuple[int, ...] = (), keep_f32: bool = False) -> None:
        """numpy [*stack, rows, cols] = GGUF [cols, rows, *stack] (stack: experts)."""
        weights = (rng.standard_normal((*stack, rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        if qtype == GGMLQuantizationType.F32 or keep_f32:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, quants.quantize(weights, qtype), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:  # a weight of 1 (Gemma's files store 1 + w: w = 0)
        writer.add_tensor(name, np.ones(size, np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", heads * head_dim, hidden)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        if arch in ("qwen3", "qwen3moe"):
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        elif arch == "gemma2":
            norm(p + "post_attention_norm.weight", hidden)
            norm(p + "post_ffw_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        if arch == "qwen3moe":
            matrix(p + "ffn_gate_inp.weight", experts, hidden, keep_f32=True)
            matrix(p + "ffn_gate_exps.weight", ffn, hidden, (experts,))
            matrix(p + "ffn_up_exps.weight", ffn, hidden, (experts,))
            matrix(p + "ffn_down_exps.weight", hidden, ffn, (experts,))
            continue
        matrix(p + "ffn_gate.weight", ffn, hidden)
        matrix(p + "ffn_up.weight", ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, ffn)
    norm("output_norm.weight", hidden)
    if untied:  # else the LM head is token_embd
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer(writer: GGUFWriter, src: GGUFReader) -> int:
    """The source file's tokenizer keys, copied as they are; returns its vocabulary size."""
    for key in _TOKENIZER_KEYS:
        field = src.fields.get(key)
        if field is None:
            continue
        value: Any = field.contents()
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    return len(src.fields["tokenizer.ggml.tokens"].data)


def main() -> None:
    from raylm.model.config.registry import DEFAULT_MODEL, resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(DEFAULT_HEADS), default="qwen3")
    ap.add_argument("--type", choices=TYPES, default="Q4_1", dest="kind")
    ap.add_argument("--src", type=Path, default=None, help="GGUF whose tokenizer to copy (default: the bundled model)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=None, help="MLP size (qwen3moe: each expert's); default per family")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--experts", type=int, default=8, help="qwen3moe: experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="qwen3moe: experts routed per token")
    ap.add_argument("--untied", action="store_true", help="an output matrix of its own (else tied to the embedding)")
    a = ap.parse_args()
    src = a.src or resolve_model_path(DEFAULT_MODEL)
    write_family_gguf(a.out, src, a.arch, a.kind, a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.head_dim,
                      experts=a.experts, top_k=a.top_k, untied=a.untied)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
