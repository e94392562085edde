"""KV bytes per token and layer: DeepSeek's latent attention (MLA) against GQA and MHA of the same width.

Every number comes from raylm's own pool declaration (``KVCache.abstract(...).nbytes``,
model/decoder/kv_pool.py, the figure ``cache.kv_budget`` sizes pools by), for one block of one
token in one layer, in float32, bfloat16 and int8 pools (an int8 pool keeps a float32 scale per
token and KV head beside its values). The models are configs only, no weights:

- MLA: DeepSeek-V3's attention (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: one latent and
  one shared rotary key per token, from which all 128 heads' keys and values are expanded);
- GQA: a Llama-style model as wide (hidden 7168, 128 query heads of head_dim 128) with 8 KV heads;
- MHA: the same with 128 KV heads.

    python -m raylm.benchmarks.mla_kv_bytes [--layers 61] [--block-size 16]

Besides bytes per token and layer it prints a whole model's per token (``--layers``, V3's 61)
and the tokens one GiB of pool holds; the ratio column is each pool's size over MLA's.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import KVCache

_WIDTH = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
              max_position_embeddings=4096, rope_theta=10000.0)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def configs(layers: int) -> dict[str, ModelConfig]:
    """The three attention kinds at DeepSeek-V3's width (all-dense configs: the pool is what counts)."""
    mla = ModelConfig.from_hf_dict(dict(
        _WIDTH, architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=layers, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=layers))

    def llama(kv_heads: int) -> ModelConfig:
        return ModelConfig.from_hf_dict(dict(_WIDTH, architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                                             head_dim=128, num_key_value_heads=kv_heads))

    return {"MLA (DeepSeek-V3: 512 + 64)": mla, "GQA (128 heads x 128, 8 KV heads)": llama(8),
            "MHA (128 heads x 128, 128 KV heads)": llama(128)}


def bytes_per_token_layer(config: ModelConfig, dtype: jnp.dtype, block_size: int) -> float:
    """One layer's pool bytes per token, as the declaration sizes a block (scales included)."""
    return KVCache.abstract(config, num_blocks=1, block_size=block_size, dtype=dtype, num_layers=1).nbytes / block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61, help="layers for the whole-model figures (V3: 61)")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    models = configs(args.layers)
    mla = next(iter(models.values()))
    print(f"{'pool':>9} | {'attention':<38} | {'B/token/layer':>13} | {'x MLA':>6} | "
          f"{f'KiB/token ({args.layers} layers)':>24} | {'tokens per GiB':>14}")
    for name, dtype in DTYPES.items():
        base = bytes_per_token_layer(mla, dtype, args.block_size)
        for label, config in models.items():
            per_layer = bytes_per_token_layer(config, dtype, args.block_size)
            per_token = per_layer * args.layers
            print(f"{name:>9} | {label:<38} | {per_layer:>13,.0f} | {per_layer / base:>6.1f} | "
                  f"{per_token / 1024:>24,.1f} | {2**30 / per_token:>14,.0f}")


if __name__ == "__main__":
    main()
