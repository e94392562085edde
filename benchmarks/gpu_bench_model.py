"""The GPU benchmark's inputs: a random-weight Llama built in device memory (no files), paged
pools and block tables laid out as the engine lays them out, the programs' arguments, and the
chip's nominal figures that the measured rates are divided by (``benchmarks/gpu_bench.py``).

Weights are drawn with ``jax.random`` on the device in the model dtype, each matrix scaled by
``1 / sqrt(fan_in)`` (its input dims) so activations stay near unit size through every layer,
norms ones: the timings do not depend on the values, but NaNs would make the greedy agreement
check meaningless. Which arrays a Llama has is read from ``model.decoder.params``' declarations:
every field without a default, plus the optional ones a dense Llama fills (``LLAMA_OPTIONAL``).

Every builder also runs abstractly (``abstract=True``: ``jax.eval_shape``, no memory), which
``--lower-only`` uses to lower the 1B and 8B programs for a GPU on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import DEFAULT_BLOCK_SIZE, KVCache
from raylm.model.decoder.params import LAYER_INFO, MODEL_INFO, ArrayInfo, LayerParams, ModelParams
from raylm.model.runtime.buckets import bucket, cdiv
from raylm.workers.runner.sampler import SamplingBatch, build_sampling_batch

BLOCK_SIZE = DEFAULT_BLOCK_SIZE
MIN_TABLE_WIDTH = 8  # the engine's smallest block-table bucket
# Optional LayerParams fields a dense Llama has (fused QKV, gate/up, down); the rest stay None.
LLAMA_OPTIONAL = frozenset({"wqkv", "w_gate_up", "w_down"})

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
              rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192))
# HF config.json fields of each shape: Llama-3.2-1B's and Llama-3.1-8B's, and a few-MB model
# for the CPU smoke run (head_dim 16: the Pallas kernel's smallest).
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The batch sizes and lengths each part runs at."""

    attention_rows: tuple[int, ...]
    attention_context: int
    attention_layers: int  # layers of the pool the attention part reads one of
    decode_rows: tuple[int, ...]  # the first is the single stream
    decode_context: int
    decode_steps: tuple[int, ...]  # decode steps per call; the last is the one the targets read
    prefill_rows: int
    prefill_tokens: int


# The sizes on a GPU; the tiny model's keep the interpret-mode kernel to a few seconds.
REAL_SIZES = Sizes(attention_rows=(64, 1), attention_context=4096, attention_layers=4, decode_rows=(1, 64),
                   decode_context=2048, decode_steps=(1, 8), prefill_rows=8, prefill_tokens=2048)
SIZES: dict[str, Sizes] = {
    "1b": REAL_SIZES,
    "8b": REAL_SIZES,
    "tiny": Sizes(attention_rows=(4, 1), attention_context=80, attention_layers=2, decode_rows=(1, 4),
                  decode_context=40, decode_steps=(1, 4), prefill_rows=2, prefill_tokens=32),
}

# Nominal figures by device kind (substring of ``jax.devices()[0].device_kind``): HBM TB/s and
# dense bfloat16 TFLOP/s (NVIDIA's spec sheets, SXM parts).
HBM_TBPS = {"H200": 4.8, "H100": 3.35}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0}


def nominal(table: dict[str, float], device_kind: str) -> float | None:
    """``table``'s figure for the first key found in ``device_kind`` (None: not a known chip)."""
    return next((value for key, value in table.items() if key in device_kind), None)


def model_config(shape: str) -> ModelConfig:
    """The ``ModelConfig`` of one of ``SHAPES``, read as raylm reads an HF config.json."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    return ModelConfig.from_hf_dict(SHAPES[shape], source=f"gpu_bench shape {shape}")


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "input_dims"))
def _random_array(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, input_dims: int | None) -> jax.Array:
    """Ones for a vector (``input_dims`` None: norms), else normal values scaled by ``1 / sqrt``
    of the product of the last ``input_dims`` dims (0: unscaled)."""
    if input_dims is None:
        return jnp.ones(shape, dtype)
    fan_in = math.prod(shape[len(shape) - input_dims:])
    return (jax.random.normal(key, shape, dtype) * (fan_in ** -0.5)).astype(dtype)


def _arrays(infos: dict[str, ArrayInfo], names: list[str], config: ModelConfig, key: jax.Array,
            dtype: Any) -> dict[str, jax.Array]:
    keys = jax.random.split(key, len(names))
    return {name: _random_array(k, shape=infos[name].shape(config), dtype=jnp.dtype(dtype),
                                input_dims=infos[name].input_dims) for name, k in zip(names, keys)}


def _filled(cls: type, extra: frozenset[str]) -> list[str]:
    """``cls``'s array fields without a default, and those of ``extra``."""
    return [f.name for f in dataclasses.fields(cls) if "info" in f.metadata
            and (f.default is dataclasses.MISSING or f.name in extra)]


def random_params(config: ModelConfig, dtype: Any, seed: int = 0) -> ModelParams:
    """A dense Llama's parameters of ``config``'s shapes, random, on the default device."""
    keys = jax.random.split(jax.random.key(seed), config.num_layers + 1)
    layers = tuple(LayerParams(**_arrays(LAYER_INFO, _filled(LayerParams, LLAMA_OPTIONAL), config, k, dtype))
                   for k in keys[1:])
    ends = frozenset({"embed"} | (set() if config.tie_word_embeddings else {"lm_head"}))
    return ModelParams(layers=layers, **_arrays(MODEL_INFO, _filled(ModelParams, ends), config, keys[0], dtype))


def maybe_abstract(abstract: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or only its shapes (``jax.eval_shape``) when ``abstract``."""
    return jax.eval_shape(functools.partial(fn, *args, **kwargs)) if abstract else fn(*args, **kwargs)


def random_pool(config: ModelConfig, num_blocks: int, dtype: Any, num_layers: int | None = None,
                seed: int = 1) -> KVCache:
    """A pool of ``num_blocks`` blocks (``KVCache.abstract``'s shape) holding random keys and
    values, drawn in place (no zeroed pool beside it: the 8B's 64-row pool is 17 GB)."""
    info = KVCache.abstract(config, num_blocks, BLOCK_SIZE, jnp.dtype(dtype), num_layers)
    if info.quantized or info.latent:
        raise ValueError(f"the benchmark's pools hold {info.dtype} keys and values of their own, not {info}")
    k_key, v_key = jax.random.split(jax.random.key(seed))
    return KVCache(*(_random_array(key, shape=info.shape, dtype=info.dtype, input_dims=0) for key in (k_key, v_key)))


def block_tables(rows: int, tokens: int, width: int | None = None) -> tuple[np.ndarray, int]:
    """Each row's own blocks for ``tokens`` tokens (rows after one another from block 1, block 0
    the null block), padded with the null block to ``width`` (default the engine's bucket: the
    power of two above the blocks plus one); and the pool's block count."""
    used = cdiv(tokens, BLOCK_SIZE)
    width = width or bucket(used + 1, MIN_TABLE_WIDTH, 1 << 30)
    tables = np.zeros((rows, width), np.int32)
    tables[:, :used] = 1 + np.arange(rows * used, dtype=np.int32).reshape(rows, used)
    return tables, rows * used + 1


def greedy_rows(rows: int, config: ModelConfig) -> SamplingBatch:
    """Sampling parameters of ``rows`` greedy rows."""
    return jax.tree_util.tree_map(jnp.asarray, build_sampling_batch([], rows, config.vocab_size, frozenset(), False))


def random_tokens(rows: int, length: int, config: ModelConfig, seed: int = 2) -> np.ndarray:
    """``[rows, length]`` token ids."""
    return np.random.default_rng(seed).integers(0, config.vocab_size, (rows, length), dtype=np.int32)


def decode_args(config: ModelConfig, params: ModelParams, kv: KVCache, rows: int, context: int,
                steps: int) -> tuple:
    """``decode_program``'s positional arguments for ``rows`` rows whose ``context`` tokens are
    in ``kv`` (the blocks of ``block_tables(rows, context + steps)``), decoding ``steps`` tokens."""
    tables, _ = block_tables(rows, context + steps)
    return (params, kv, jnp.asarray(random_tokens(rows, 1, config)[:, 0]), jnp.full((rows,), context, jnp.int32),
            jnp.asarray(tables), jnp.full((rows,), context + steps, jnp.int32), greedy_rows(rows, config))


def decode_kwargs(config: ModelConfig, steps: int, gpu_kernels: bool, return_logits: bool = False) -> dict:
    return dict(config=config, num_steps=steps, num_logprobs=0, with_penalties=False, cpu_kernels=False,
                gpu_kernels=gpu_kernels, return_logits=return_logits)


def prefill_args(config: ModelConfig, params: ModelParams, kv: KVCache, rows: int, tokens: int) -> tuple:
    """``prefill_program``'s positional arguments: a ``tokens``-long prompt per row from position 0."""
    tables, _ = block_tables(rows, tokens)
    return (params, kv, None, None, jnp.asarray(random_tokens(rows, tokens, config)),
            jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (rows, tokens)), jnp.asarray(tables),
            jnp.full((rows,), tokens, jnp.int32), greedy_rows(rows, config))


def prefill_kwargs(config: ModelConfig, gpu_kernels: bool) -> dict:
    return dict(config=config, draft_config=None, num_logprobs=0, with_penalties=False, gpu_kernels=gpu_kernels)
