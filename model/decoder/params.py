"""The parameter pytree: dataclasses whose array fields are JAX leaves.

Each decoder layer has its own arrays (``ModelParams.layers`` is a tuple), and the forward
pass loops over them in Python. A stacked ``[L, ...]`` layout under ``lax.scan`` compiles
faster, but XLA's CPU backend then copies every layer's weights out of the stack on every
step (dynamic-slice), which measured ~1.4x slower at batch 1 (see
``benchmarks/decode_step_bench.py``).

Matrices are stored output-first with their input dims last and contiguous (HF's
``[out, in]``): each output's weights are one run of memory, which is what the CPU
small-batch matmul kernel streams (model/kernels/dense.py) and what XLA's own dot handled best
too at decode batch sizes. Q, K and V are one fused matrix and gate/up another, so a
layer runs three matmuls before attention fewer (at batch 1 each matmul is bound by reading
its weights, and the fused one reads them in one pass). The QKV columns are grouped by KV
head: KV head ``k`` owns query heads ``k*G .. k*G+G-1`` (``G = H / KVH``, as in HF's GQA),
then its key, then its value. So splitting the ``kv_heads`` axis over tensor-parallel
devices gives each device whole groups, with the query heads that read its keys.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax

if TYPE_CHECKING:
    from raylm.model.config.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Everything declared about one parameter, once: its shape for a config, the logical name
    of each dim (model/runtime/sharding.py maps names onto a mesh), and for matrices (``dense``
    weights, stored [out..., in...]) how many trailing dims are inputs. Matrices are what
    weight-only quantization replaces by a QuantArray with a scale per output channel
    (model/quantization/quant_array.py); the embedding is one too: as the tied LM head it is a [V, D]
    matrix, and its rows are the lookup's per-token scales. Every array has the model dtype, but a
    float32 model may keep its checkpoint's bfloat16 or float16 matrices (model/loaders/hf_tensors.py;
    the dense kernels and the embedding lookup widen them exactly)."""

    shape: Callable[[ModelConfig], tuple[int, ...]]
    logical_axes: tuple[str, ...]
    input_dims: int | None = None  # None: not a matrix

    def __post_init__(self) -> None:
        assert self.input_dims is None or 0 < self.input_dims < len(self.logical_axes), self


def _param(info: ArrayInfo, optional: bool = False) -> Any:
    """A dataclass field carrying its ArrayInfo (``optional``: absent for some models, None)."""
    extra = {"default": None} if optional else {}
    return dataclasses.field(metadata={"info": info}, **extra)


def _norm() -> ArrayInfo:
    return ArrayInfo(lambda c: (c.hidden_size,), ("embed",))


def _head_norm(heads: Callable[[ModelConfig], int]) -> ArrayInfo:
    """A q or k norm: over one head (shared by all), or over all ``heads`` at once (OLMoE)."""
    return ArrayInfo(lambda c: (heads(c) * c.head_dim if c.qk_norm_whole else c.head_dim,), ("head_dim",))


def _vocab_matrix() -> ArrayInfo:
    return ArrayInfo(lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed"), input_dims=1)


def _mla_heads(rows: Callable[[ModelConfig], int], inputs: Callable[[ModelConfig], int],
               input_axis: str) -> ArrayInfo:
    """An MLA matrix with ``rows(c)`` outputs per query head (split over tensor parallelism)."""
    return ArrayInfo(lambda c: (c.num_heads, rows(c), inputs(c)), ("heads", "head_dim", input_axis), input_dims=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(kw_only=True)
class LayerParams:
    """One decoder layer's weights (matrices may be QuantArrays of the same shape)."""

    attn_norm: jax.Array = _param(_norm())
    # Per KV head: its G query heads, its key, its value (absent with latent attention).
    wqkv: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.num_kv_heads, c.q_per_kv + 2, c.head_dim, c.hidden_size),
                                                 ("kv_heads", "qkv", "head_dim", "embed"), input_dims=1), optional=True)
    wo: jax.Array = _param(ArrayInfo(lambda c: (c.hidden_size, c.num_heads, c.attn_out_dim),
                                     ("embed", "heads", "head_dim"), input_dims=2))
    mlp_norm: jax.Array = _param(_norm())
    # The dense MLP (absent in a sparse layer): gate, then up.
    w_gate_up: Optional[jax.Array] = _param(ArrayInfo(lambda c: (2, c.intermediate_size, c.hidden_size),
                                                      ("gate_up", "mlp", "embed"), input_dims=1), optional=True)
    w_down: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.hidden_size, c.intermediate_size), ("embed", "mlp"),
                                                   input_dims=1), optional=True)
    bqkv: Optional[jax.Array] = _param(  # Qwen2's attention bias
        ArrayInfo(lambda c: (c.num_kv_heads, c.q_per_kv + 2, c.head_dim), ("kv_heads", "qkv", "head_dim")),
        optional=True)
    q_norm: Optional[jax.Array] = _param(_head_norm(lambda c: c.num_heads), optional=True)  # qk_norm models
    k_norm: Optional[jax.Array] = _param(_head_norm(lambda c: c.num_kv_heads), optional=True)
    post_attn_norm: Optional[jax.Array] = _param(_norm(), optional=True)  # sandwich_norms models (Gemma)
    post_mlp_norm: Optional[jax.Array] = _param(_norm(), optional=True)
    # A sparse layer's experts (model/decoder/moe.py), stacked: the router's logits per expert (kept
    # unquantized: it picks the experts), each expert's gate/up and down.
    router: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts, c.hidden_size), ("router", "embed")), optional=True)
    w_experts_gate_up: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts, 2, c.moe.expert_size, c.hidden_size),
                  ("experts", "gate_up", "expert_mlp", "embed"), input_dims=1), optional=True)
    w_experts_down: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts, c.hidden_size, c.moe.expert_size),
                  ("experts", "embed", "expert_mlp"), input_dims=1), optional=True)
    # The shared expert: a dense MLP beside the experts, scaled by sigmoid(x . shared_gate)
    # (Qwen2-MoE) or not (DeepSeek, GLM-4.5: no shared_gate).
    w_shared_gate_up: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (2, c.moe.shared_expert_size, c.hidden_size), ("gate_up", "mlp", "embed"), input_dims=1),
        optional=True)
    w_shared_down: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.hidden_size, c.moe.shared_expert_size), ("embed", "mlp"), input_dims=1), optional=True)
    shared_gate: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.hidden_size,), ("embed",)), optional=True)
    # DeepSeek V3 / GLM-4.5's per-expert bias added to the router's scores to choose experts
    # (model/decoder/deepseek_routing.py); float32 whatever the model dtype, as HF keeps it.
    router_score_bias: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts,), ("router",)), optional=True)
    # gpt-oss: the output projection's bias, each query head's attention sink (a logit in its
    # softmax's denominator), the router's bias and each expert's gate/up and down biases.
    bo: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.hidden_size,), ("embed",)), optional=True)
    sinks: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.num_heads,), ("heads",)), optional=True)
    router_bias: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.moe.num_experts,), ("router",)), optional=True)
    b_experts_gate_up: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts, 2, c.moe.expert_size), ("experts", "gate_up", "expert_mlp")),
        optional=True)
    b_experts_down: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.moe.num_experts, c.hidden_size), ("experts", "embed")), optional=True)
    # DeepSeek's latent attention (model/decoder/latent_attention.py), HF's names: the query by
    # q_proj, or by q_a_proj, its norm and q_b_proj (q_lora_rank); each head's non-rotary then
    # rotary part. kv_a_proj_with_mqa: the latent, then the shared rotary key; the latent's norm;
    # kv_b_proj: each head's non-rotary key then value, from the latent. The latent is replicated
    # under tensor parallelism, the heads split.
    wq: Optional[jax.Array] = _param(_mla_heads(lambda c: c.mla.qk_head_dim, lambda c: c.hidden_size, "embed"),
                                     optional=True)
    wq_a: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.mla.q_lora_rank, c.hidden_size), ("q_lora", "embed"), input_dims=1), optional=True)
    q_a_norm: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.mla.q_lora_rank,), ("q_lora",)), optional=True)
    wq_b: Optional[jax.Array] = _param(
        _mla_heads(lambda c: c.mla.qk_head_dim, lambda c: c.mla.q_lora_rank, "q_lora"), optional=True)
    wkv_a: Optional[jax.Array] = _param(
        ArrayInfo(lambda c: (c.mla.latent_dim, c.hidden_size), ("latent", "embed"), input_dims=1), optional=True)
    kv_a_norm: Optional[jax.Array] = _param(ArrayInfo(lambda c: (c.mla.kv_lora_rank,), ("latent",)), optional=True)
    wkv_b: Optional[jax.Array] = _param(
        _mla_heads(lambda c: c.mla.qk_nope_head_dim + c.mla.v_head_dim, lambda c: c.mla.kv_lora_rank, "latent"),
        optional=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(kw_only=True)
class ModelParams:
    """A whole Llama-family model. ``lm_head`` is None when tied to ``embed``. A pipeline
    stage's holds its layers alone (``model.loaders.hf_tensors.build_params``' ``layers``):
    ``embed`` only on the first stage and a tied model's last, ``lm_head`` only on the last."""

    embed: Optional[jax.Array] = _param(_vocab_matrix(), optional=True)
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array = _param(_norm())
    lm_head: Optional[jax.Array] = _param(_vocab_matrix(), optional=True)  # as the tied embedding


def stage_ends(is_first: bool, is_last: bool, tied: bool) -> tuple[bool, bool]:
    """Whether a pipeline stage (of ``ModelParams``' docstring) holds the embedding and the LM head:
    the first stage looks tokens up, the last computes logits (from the embedding when tied)."""
    return is_first or (is_last and tied), is_last and not tied


def _infos(cls: type) -> dict[str, ArrayInfo]:
    return {f.name: f.metadata["info"] for f in dataclasses.fields(cls) if "info" in f.metadata}


LAYER_INFO: dict[str, ArrayInfo] = _infos(LayerParams)
MODEL_INFO: dict[str, ArrayInfo] = _infos(ModelParams)  # all but ``layers``
# Derived views, by field name: logical axes, and the matrices' input dims.
LAYER_AXES: dict[str, tuple[str, ...]] = {name: info.logical_axes for name, info in LAYER_INFO.items()}
MODEL_AXES: dict[str, tuple[str, ...]] = {name: info.logical_axes for name, info in MODEL_INFO.items()}
LAYER_MATRIX_INPUT_DIMS: dict[str, int] = {n: i.input_dims for n, i in LAYER_INFO.items() if i.input_dims}
MODEL_MATRIX_INPUT_DIMS: dict[str, int] = {n: i.input_dims for n, i in MODEL_INFO.items() if i.input_dims}


def shape_mismatches(params: ModelParams, config: ModelConfig) -> list[str]:
    """``"field: shape, expected shape"`` for every array whose shape is not what its ArrayInfo
    says for ``config`` (absent optional fields are not checked)."""

    def check(where: str, info: ArrayInfo, array: Any) -> list[str]:
        if array is None:
            return []
        expected = info.shape(config)
        return [] if tuple(array.shape) == expected else [f"{where}: {tuple(array.shape)}, expected {expected}"]

    out = [m for name, info in MODEL_INFO.items() for m in check(name, info, getattr(params, name))]
    for i, layer in enumerate(params.layers):
        out += [m for name, info in LAYER_INFO.items() for m in check(f"layers[{i}].{name}", info, getattr(layer, name))]
    if len(params.layers) != config.num_layers:
        out.append(f"layers: {len(params.layers)}, expected {config.num_layers}")
    return out
