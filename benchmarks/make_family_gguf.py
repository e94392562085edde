"""Write a random-weight GGUF of a family (Llama, Qwen3, Gemma 2, Qwen3-MoE, DeepSeek-V2, gpt-oss) for benchmarks.

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
active per token at the defaults. DeepSeek-V2 (``--arch deepseek2``, issue 66) is DeepSeek-V2-Lite's
shape at the defaults: latent attention (hidden 2048, 16 heads, a 512-wide latent, 128 + 64 query /
key dims, 128 value dims, a full-rank query), a dense first layer (MLP ``--dense-ffn`` 10944), then
64 routed experts of 1408 (softmax scores, top 6, not renormalized) and 2 shared ones per layer,
YaRN (factor 40 over 4096 positions, mscale 0.707); 27 layers as V2-Lite has (``--layers 27``,
15.7B parameters, 2.4B active per token). Its kv_b_proj is split into ``attn_k_b`` / ``attn_v_b``
with the heads' sizes in ``key_length_mla`` / ``value_length_mla``, as today's converter writes
it, so llama.cpp runs its absorbed MLA with a latent cache, as raylm does. gpt-oss (``--arch
gpt-oss``, issue 66) is gpt-oss-20b's shape at the defaults: hidden 2880, 64 query heads and 8 KV
heads of 64 with biases (the output projection's too) and a sink per head, a 128-token window on
every other layer (the first sliding, as llama.cpp fixes it), 32 experts of 2880 routed top-4 with
router and expert biases (llama.cpp fixes the clamped SwiGLU), YaRN as its config.json states it
(base 150000, factor 32 over 4096 positions, betas 32 / 1), an untied output matrix; 24 layers
(``--layers 24``: 20.0B parameters with the bundled tokenizer's 49,152 tokens, where gpt-oss's own
201,088 make 20.9B; 3.2B active per token). The experts are MXFP4 as in llama.cpp's released
gpt-oss files (GptOssModel repacks the checkpoint's MXFP4 blocks as they are); the other matrices
there are Q8_0 (the default ``--type`` here), routers, biases, sinks and norms F32: at 24 layers
459 tensors (289 F32, 98 Q8_0, 72 MXFP4), as many as ggml-org's gpt-oss-20b-mxfp4.gguf holds.
Outputs are noise: benchmarks use ``ignore_eos``.

    python -m raylm.benchmarks.make_family_gguf OUT.gguf [--arch qwen3|gemma2|qwen3moe|deepseek2|gpt-oss]
        [--type Q4_1] [--src SRC.gguf] [--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --head-dim 128]
        [--experts 8 --top-k 2] [--dense-ffn 10944 --shared-experts 2]

``--type`` is the matrices' GGUF type (F32, F16, Q8_0, Q4_0, Q4_1; norms and routers stay F32 as
llama-quantize keeps them; gpt-oss's experts are MXFP4 whatever it says). Quantized matrices are
random blocks (benchmarks/random_blocks.py: random bits, scales of a sane magnitude), written
without quantizing floats, so that a 15B-parameter file takes a minute. ``--arch llama`` writes
Llama 3's layout (``--untied``: an output matrix of its own, as Llama-3.1-8B has);
benchmarks/make_test_ggufs.py sizes it like the models people download and quantizes it with
llama-quantize.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

from raylm.benchmarks.random_blocks import F16_SCALED_TYPES, random_blocks
from raylm.model.config.latent_attention import LatentAttention
from raylm.model.loaders.gguf_file import GGUFReader

# Per family: (default heads, KV heads, head size) giving the Llama file's matmul shapes
# (deepseek2: V2-Lite's heads; its one "KV head" is the latent, its head sizes are ``mla``'s).
DEFAULT_HEADS = {"llama": (16, 8, 128), "qwen3": (16, 8, 128), "gemma2": (8, 4, 256), "qwen3moe": (16, 8, 128),
                 "deepseek2": (16, 1, 192), "gpt-oss": (64, 8, 64)}
# MoE families: each expert's MLP; the others: the MLP.
DEFAULT_FFN = {"llama": 8192, "qwen3": 8192, "gemma2": 8192, "qwen3moe": 1024, "deepseek2": 1408, "gpt-oss": 2880}
DEFAULT_EXPERTS = {"qwen3moe": (8, 2), "deepseek2": (64, 6), "gpt-oss": (32, 4)}  # (experts, routed per token)
DEFAULT_HIDDEN = {"gpt-oss": 2880}  # (the others: 2048)
DEFAULT_LAYERS = {"deepseek2": 27, "gpt-oss": 24}  # (the others: 16)
DEFAULT_TYPE = {"gpt-oss": "Q8_0"}  # (the others: Q4_1)
# DeepSeek-V2-Lite's latent attention (its config.json: no q LoRA) and YaRN.
V2_LITE_MLA = LatentAttention(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
V2_LITE_YARN = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale_all_dim": 0.707}
# gpt-oss-20b's config.json: its window, its YaRN (rope_parameters), its context.
GPT_OSS_20B_WINDOW, GPT_OSS_20B_CONTEXT = 128, 131072
GPT_OSS_20B_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)


def write_family_gguf(
    out: Path, src: Path, arch: str = "qwen3", kind: str = "Q4_1", layers: int = 16, hidden: int | None = None,
    ffn: int | None = None, heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
    seed: int = 0, experts: int | None = None, top_k: int | None = None, untied: bool = False,
    mla: LatentAttention = V2_LITE_MLA, dense_ffn: int = 10944, shared_experts: int = 2,
) -> Path:
    """Write the file; returns ``out``. ``hidden`` / ``ffn`` / ``heads`` / ``kv_heads`` / ``head_dim`` /
    ``experts`` / ``top_k`` default per family; ``untied``: an output matrix of its own (always
    for deepseek2 and gpt-oss).
    deepseek2 only: ``mla`` (its attention's sizes; ``head_dim`` and ``kv_heads`` are not used),
    ``dense_ffn`` (layer 0's MLP), ``shared_experts`` (each ``ffn`` wide); its output matrix is
    always its own, as V2-Lite's."""
    defaults = DEFAULT_HEADS[arch]
    hidden = hidden or DEFAULT_HIDDEN.get(arch, 2048)
    ffn = ffn or DEFAULT_FFN[arch]
    heads, kv_heads, head_dim = heads or defaults[0], kv_heads or defaults[1], head_dim or defaults[2]
    experts = experts or DEFAULT_EXPERTS.get(arch, (0, 0))[0]
    top_k = top_k or DEFAULT_EXPERTS.get(arch, (0, 0))[1]
    deepseek, gpt_oss = arch == "deepseek2", arch == "gpt-oss"
    qtype = GGMLQuantizationType[kind]
    writer = GGUFWriter(str(out), arch, use_temp_file=True)
    writer.add_name(f"raylm-random-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(163840 if deepseek else GPT_OSS_20B_CONTEXT if gpt_oss else 8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(dense_ffn if deepseek else ffn)
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(1e-5 if gpt_oss else 1e-6)
    if deepseek:
        _deepseek2_keys(writer, mla, experts, top_k, ffn, shared_experts)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_rope_freq_base(1_000_000.0)
    elif arch == "llama":
        writer.add_rope_freq_base(500_000.0)
        writer.add_rope_dimension_count(head_dim)
    elif arch == "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's 10000) and these three
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
        writer.add_sliding_window(4096)
    elif gpt_oss:
        _gpt_oss_keys(writer, experts, top_k, ffn)
    if arch == "qwen3moe":
        writer.add_expert_count(experts)
        writer.add_expert_used_count(top_k)
        writer.add_expert_feed_forward_length(ffn)
    vocab = _copy_tokenizer(writer, GGUFReader(str(src)))
    if arch in ("llama", "deepseek2"):
        writer.add_vocab_size(vocab)

    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, stack: tuple[int, ...] = (), keep_f32: bool = False,
               kind: GGMLQuantizationType = qtype) -> None:
        """numpy [*stack, rows, cols] = GGUF [cols, rows, *stack] (stack: experts or heads)."""
        shape = (*stack, rows, cols)
        kind = GGMLQuantizationType.F32 if keep_f32 else kind
        if kind in F16_SCALED_TYPES or kind == GGMLQuantizationType.MXFP4:
            writer.add_tensor(name, random_blocks(kind, shape, int(rng.integers(2**31))), raw_dtype=kind)
            return
        weights = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, weights)
        else:  # F16
            writer.add_tensor(name, quants.quantize(weights, kind), raw_dtype=kind)

    def norm(name: str, size: int) -> None:  # a weight of 1 (Gemma's files store 1 + w: w = 0)
        writer.add_tensor(name, np.ones(size, np.float32))

    def bias(name: str, *shape: int) -> None:  # (gpt-oss's biases and sinks: small, F32)
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        if deepseek:
            _deepseek2_layer(p, i, matrix, norm, hidden, heads, mla, experts, ffn, dense_ffn, shared_experts)
            continue
        if gpt_oss:
            _gpt_oss_layer(p, matrix, norm, bias, hidden, heads, kv_heads, head_dim, experts, ffn)
            continue
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
    if untied or deepseek or gpt_oss:  # else the LM head is token_embd
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _deepseek2_keys(writer: GGUFWriter, mla: LatentAttention, experts: int, top_k: int, ffn: int,
                    shared_experts: int) -> None:
    """The keys DeepseekV2Model.set_gguf_parameters writes for V2-Lite's config.json (and
    TextModel's: experts, groups, scoring, YaRN)."""
    writer.add_head_count_kv(1)  # (the one latent every head reads)
    # llama.cpp reads q_lora_rank unless the file has V2-Lite's 27 (or 26) layers: 0 states "none"
    # for files of fewer layers (llama.cpp and raylm then read a full-rank attn_q).
    writer.add_q_lora_rank(0)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    writer.add_key_length(mla.latent_dim)  # the latent cache's sizes, then the heads'
    writer.add_value_length(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_head_dim)
    writer.add_value_length_mla(mla.v_head_dim)
    writer.add_rope_dimension_count(mla.qk_rope_head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(V2_LITE_YARN["factor"])
    writer.add_rope_scaling_orig_ctx_len(V2_LITE_YARN["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(V2_LITE_YARN["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(V2_LITE_YARN["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * V2_LITE_YARN["mscale_all_dim"])  # (the converter's factor 0.1)
    writer.add_leading_dense_block_count(1)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_group_count(1)
    writer.add_expert_group_used_count(1)
    writer.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_feed_forward_length(ffn)
    writer.add_expert_shared_count(shared_experts)
    writer.add_expert_weights_scale(1.0)


def _deepseek2_layer(p: str, i: int, matrix: Any, norm: Any, hidden: int, heads: int, mla: LatentAttention,
                     experts: int, ffn: int, dense_ffn: int, shared_experts: int) -> None:
    """Layer ``i``'s tensors (prefix ``p``) after its attn_norm: latent attention with kv_b split as
    DeepseekV2Model.modify_tensors splits it (attn_k_b [H, rank, nope]: each head's key rows
    transposed; attn_v_b [H, v, rank]), then layer 0's dense MLP or the routed and shared experts."""
    matrix(p + "attn_q.weight", heads * mla.qk_head_dim, hidden)
    matrix(p + "attn_kv_a_mqa.weight", mla.latent_dim, hidden)
    norm(p + "attn_kv_a_norm.weight", mla.kv_lora_rank)
    matrix(p + "attn_k_b.weight", mla.kv_lora_rank, mla.qk_nope_head_dim, (heads,))
    matrix(p + "attn_v_b.weight", mla.v_head_dim, mla.kv_lora_rank, (heads,))
    matrix(p + "attn_output.weight", hidden, heads * mla.v_head_dim)
    norm(p + "ffn_norm.weight", hidden)
    if i == 0:
        matrix(p + "ffn_gate.weight", dense_ffn, hidden)
        matrix(p + "ffn_up.weight", dense_ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, dense_ffn)
        return
    matrix(p + "ffn_gate_inp.weight", experts, hidden, keep_f32=True)
    matrix(p + "ffn_gate_exps.weight", ffn, hidden, (experts,))
    matrix(p + "ffn_up_exps.weight", ffn, hidden, (experts,))
    matrix(p + "ffn_down_exps.weight", hidden, ffn, (experts,))
    matrix(p + "ffn_gate_shexp.weight", shared_experts * ffn, hidden)
    matrix(p + "ffn_up_shexp.weight", shared_experts * ffn, hidden)
    matrix(p + "ffn_down_shexp.weight", hidden, shared_experts * ffn)


def _gpt_oss_keys(writer: GGUFWriter, experts: int, top_k: int, ffn: int) -> None:
    """The keys GptOssModel.set_gguf_parameters (TextModel's, then its window and expert size)
    writes for gpt-oss-20b's config.json beside the shapes' own: its YaRN, its experts."""
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(GPT_OSS_20B_YARN["factor"])
    writer.add_rope_scaling_orig_ctx_len(GPT_OSS_20B_YARN["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(GPT_OSS_20B_YARN["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(GPT_OSS_20B_YARN["beta_slow"])
    writer.add_rope_freq_base(GPT_OSS_20B_YARN["rope_theta"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_sliding_window(GPT_OSS_20B_WINDOW)
    writer.add_expert_feed_forward_length(ffn)


def _gpt_oss_layer(p: str, matrix: Any, norm: Any, bias: Any, hidden: int, heads: int, kv_heads: int,
                   head_dim: int, experts: int, ffn: int) -> None:
    """Layer ``p``'s tensors after its attn_norm, as llama.cpp's openai-moe loader requires them:
    biased q/k/v/output, a sink per head, the norm before the experts (post_attention_norm), the
    biased router (F32), and the experts as GptOssModel writes them: gate_up split into gate
    (even rows) and up (odd rows), outputs first, MXFP4, with F32 biases [E, out]."""
    for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                             ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim)):
        matrix(f"{p}{name}.weight", rows, cols)
        bias(f"{p}{name}.bias", rows)
    bias(p + "attn_sinks.weight", heads)
    norm(p + "post_attention_norm.weight", hidden)
    matrix(p + "ffn_gate_inp.weight", experts, hidden, keep_f32=True)
    bias(p + "ffn_gate_inp.bias", experts)
    mxfp4 = GGMLQuantizationType.MXFP4
    for name, rows, cols in (("ffn_gate_exps", ffn, hidden), ("ffn_up_exps", ffn, hidden),
                             ("ffn_down_exps", hidden, ffn)):
        matrix(f"{p}{name}.weight", rows, cols, (experts,), kind=mxfp4)
        bias(f"{p}{name}.bias", experts, rows)


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
    ap.add_argument("--type", choices=TYPES, default=None, dest="kind", help="default Q4_1 (gpt-oss: Q8_0)")
    ap.add_argument("--src", type=Path, default=None, help="GGUF whose tokenizer to copy (default: the bundled model)")
    ap.add_argument("--layers", type=int, default=None, help="default 16 (deepseek2: 27, V2-Lite's; gpt-oss: 24)")
    ap.add_argument("--hidden", type=int, default=None, help="default 2048 (gpt-oss: 2880)")
    ap.add_argument("--ffn", type=int, default=None,
                    help="MLP size (qwen3moe, deepseek2: each expert's); default per family")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None,
                    help="qwen3moe / deepseek2 / gpt-oss: routed experts per layer (8 / 64 / 32)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="qwen3moe / deepseek2 / gpt-oss: experts routed per token (2 / 6 / 4)")
    ap.add_argument("--dense-ffn", type=int, default=10944, help="deepseek2: the dense first layer's MLP size")
    ap.add_argument("--shared-experts", type=int, default=2, help="deepseek2: shared experts per layer")
    ap.add_argument("--untied", action="store_true", help="an output matrix of its own (else tied to the embedding)")
    a = ap.parse_args()
    src = a.src or resolve_model_path(DEFAULT_MODEL)
    layers = a.layers or DEFAULT_LAYERS.get(a.arch, 16)
    kind = a.kind or DEFAULT_TYPE.get(a.arch, "Q4_1")
    write_family_gguf(a.out, src, a.arch, kind, layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.head_dim,
                      experts=a.experts, top_k=a.top_k, untied=a.untied, dense_ffn=a.dense_ffn,
                      shared_experts=a.shared_experts)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
