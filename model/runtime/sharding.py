"""Tensor and expert parallelism: one rules table maps logical axis names onto the mesh axes
``tp`` and ``ep``.

Attention heads, KV heads and the MLP hidden dimension are split over ``tp``; everything
else is replicated. jit then inserts the collectives. With one device every spec is
trivially replicated, so the single-device path is the same code.

LoRA adapter slots (model/decoder/lora_slots.py) follow their base matrices: ``A`` is split like the
matrix's input dims, ``B`` like its output dims, the slot and rank dims are replicated.

The fused QKV matrix is grouped by KV head (model/decoder/params.py), so splitting its ``kv_heads``
axis hands each device whole groups: its KV heads with the query heads that read them,
and ``wo``'s ``heads`` split lines up with it. A quantized matrix's scales are split like
its output dims. When ``tp`` does not divide the KV head count
but is a multiple of it, KV heads (and so the fused QKV projection) are replicated, as vLLM
replicates KV heads; ``wo`` and the MLP are still split.

Expert parallelism splits a mixture-of-experts layer's stacked experts over ``ep`` (the mesh
is ``ep x tp``; everything else is replicated over ``ep``, split over ``tp`` as above). Each
device then holds ``num_experts / ep`` experts; every device sees the step's tokens, runs
its own experts on the rows routed to them, and one all-reduce over ``ep`` sums the shares
(model/decoder/expert_parallel.py, a ``shard_map`` around the expert block): dispatch by gather
and combine by all-reduce rather than all-to-all, which at a decode step's few rows moves less.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.lora_slots import LayerSlots, LoraWeights, lora_axes
from raylm.model.decoder.params import LAYER_AXES, MODEL_AXES, LayerParams, ModelParams
from raylm.model.errors import UnsupportedModelError
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.model.quantization.quant_array import QuantArray

TP_AXIS = "tp"
EP_AXIS = "ep"

# Logical axis -> mesh axis (None = replicated). The one place sharding is decided.
DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": None,
    "embed": None,
    "layers": None,
    "heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "head_dim": None,
    "qkv": None,
    "mlp": TP_AXIS,
    "gate_up": None,
    "experts": EP_AXIS,
    "router": None,  # the router's experts: every device routes every token
    "expert_mlp": None,
    "blocks": None,
    "block_slot": None,
    "lora_slots": None,
    "lora_rank": None,
    "q_lora": None,  # MLA's low-rank query and its latent: replicated, the heads they expand to split
    "latent": None,
}


def array_mesh(array: Any, axis: str) -> Mesh | AbstractMesh | None:
    """The mesh ``array`` (a QuantArray: its values) is laid out on when that mesh's ``axis`` has
    more than one device, else None (one device; GGUF blocks and other non-arrays, never sharded).
    Read from the array's type, which carries its mesh inside ``jit`` as outside, so the forward
    pass needs no mesh argument."""
    leaf = array.q if isinstance(array, QuantArray) else array
    if not isinstance(leaf, jax.Array):
        return None
    mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
    if mesh is None or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None
    return mesh


def make_mesh(tp: int = 1, devices: Sequence[jax.Device] | None = None, ep: int = 1) -> Mesh:
    """An ``ep x tp`` mesh (axes ``ep``, ``tp``) over the first ``ep * tp`` devices: this process's,
    or under ``jax.distributed`` (a mesh over several hosts) every process's, in process order."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or ep < 1 or tp * ep > len(devices):
        raise ValueError(
            f"tensor parallel size {tp} x expert parallel size {ep} needs {tp * ep} devices but {len(devices)} "
            "are visible; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    return Mesh(np.array(devices[: tp * ep]).reshape(ep, tp), (EP_AXIS, TP_AXIS))


def check_expert_parallel(config: ModelConfig, ep: int) -> None:
    """Checks that ``ep`` devices can split the model's experts evenly."""
    if ep == 1:
        return
    if config.moe is None:
        raise UnsupportedModelError(f"expert parallel size {ep}: {config.architecture} has no experts")
    if config.moe.num_experts % ep:
        raise UnsupportedModelError(
            f"expert parallel size {ep} does not divide the expert count {config.moe.num_experts}"
        )


def rules_for(config: ModelConfig, tp: int, ep: int = 1) -> dict[str, str | None]:
    """The rules table specialised to a model: checks divisibility, replicates KV heads if needed."""
    check_expert_parallel(config, ep)
    rules = dict(DEFAULT_RULES)
    if tp == 1:
        return rules
    if config.num_heads % tp:
        divisors = [d for d in range(1, config.num_heads + 1) if config.num_heads % d == 0]
        raise UnsupportedModelError(
            f"tensor parallel size {tp} does not divide num_attention_heads={config.num_heads}; "
            f"choose tp from {divisors}"
        )
    if config.intermediate_size % tp:
        raise UnsupportedModelError(
            f"tensor parallel size {tp} does not divide intermediate_size={config.intermediate_size}"
        )
    shared = config.moe.shared_expert_size if config.moe else 0
    if shared % tp:
        raise UnsupportedModelError(f"tensor parallel size {tp} does not divide shared_expert_intermediate_size={shared}")
    if config.num_kv_heads % tp:
        if tp % config.num_kv_heads:
            raise UnsupportedModelError(
                f"tensor parallel size {tp} neither divides nor is a multiple of "
                f"num_key_value_heads={config.num_kv_heads}"
            )
        rules["kv_heads"] = None  # replicate KV heads (and the fused QKV projection)
    return rules


def spec_for(axes: Sequence[str], rules: Mapping[str, str | None]) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry the logical names ``axes``."""
    return PartitionSpec(*(rules[a] for a in axes))


def _named_by_rules(config: ModelConfig, mesh: Mesh) -> Any:
    """``named(axes, leaf)``: the sharding of a parameter whose dims carry the logical ``axes``
    (a leaf-shaped tree for quantized matrices; None where the field is absent)."""
    rules = rules_for(config, mesh.shape[TP_AXIS], mesh.shape.get(EP_AXIS, 1))

    def named(axes: Sequence[str], leaf: object) -> NamedSharding | QuantArray | GgufBlocks | Int8Panels | None:
        # Matrices keep their static fields, so the trees match.
        if isinstance(leaf, QuantArray):  # the scales follow the matrix's output dims
            return dataclasses.replace(leaf, q=named(axes, leaf.q), scale=named(axes[: leaf.scale.ndim], leaf.scale))
        if isinstance(leaf, GgufBlocks):  # served by the unsharded kernel only
            if mesh.devices.size > 1:
                raise ValueError(
                    "GGUF blocks (and int8_g32 matrices, which are held as blocks) are served on one device; "
                    f"load the model with gguf_blocks='expand' (quantization int8) to shard it over {mesh.devices.size}"
                )
            whole = NamedSharding(mesh, PartitionSpec())
            return dataclasses.replace(leaf, q=whole, scale=whole, offset=whole,
                                       supers=None if leaf.supers is None else whole)
        if isinstance(leaf, Int8Panels):  # the integer mode runs unsharded (the engine checks)
            whole = NamedSharding(mesh, PartitionSpec())
            return dataclasses.replace(leaf, q=whole, scale=whole, offset=whole, row_scale=whole, sub_scale=whole,
                                       codebook=whole)
        return None if leaf is None else NamedSharding(mesh, spec_for(axes, rules))

    return named


def _layer_shardings(lp: LayerParams, named: Any) -> LayerParams:
    return LayerParams(**{f.name: named(LAYER_AXES[f.name], getattr(lp, f.name)) for f in dataclasses.fields(LayerParams)})


def param_shardings(params: ModelParams, config: ModelConfig, mesh: Mesh) -> ModelParams:
    """A ModelParams-shaped tree of NamedShardings (None where the field is absent)."""
    named = _named_by_rules(config, mesh)
    return ModelParams(
        embed=named(MODEL_AXES["embed"], params.embed),
        layers=tuple(_layer_shardings(lp, named) for lp in params.layers),
        final_norm=named(MODEL_AXES["final_norm"], params.final_norm),
        lm_head=named(MODEL_AXES["lm_head"], params.lm_head),
    )


def shard_params(params: ModelParams, config: ModelConfig, mesh: Mesh) -> ModelParams:
    """Place every parameter on ``mesh`` according to the rules table."""
    return jax.device_put(params, param_shardings(params, config, mesh))


class ParamPlacer:
    """Places parameters on ``mesh`` (the rules table's shardings) one layer at a time, as the
    loader builds them (model/loaders/hf_tensors.py ``build_params``). Why: placed after the whole
    model was built, every process first held every weight unsharded on its first device, so a
    mesh over several hosts needed the whole model in each host's memory (and one process's mesh
    twice the model's bytes at its peak). Placed as built, a process holds its shards plus one
    layer unsharded; ``shard_params`` later leaves placed arrays where they are."""

    def __init__(self, config: ModelConfig, mesh: Mesh):
        self.mesh = mesh
        self._named = _named_by_rules(config, mesh)

    def layer(self, lp: LayerParams) -> LayerParams:
        return jax.device_put(lp, _layer_shardings(lp, self._named))

    def model_field(self, name: str, leaf: Any) -> Any:
        """``ModelParams.<name>`` (embed, final_norm, lm_head) placed; None stays None."""
        return None if leaf is None else jax.device_put(leaf, self._named(MODEL_AXES[name], leaf))


def shard_lora(weights: LoraWeights, config: ModelConfig, mesh: Mesh) -> LoraWeights:
    """Place LoRA slots on ``mesh``: each ``A`` split like its base matrix's inputs, each ``B``
    like its outputs (model/decoder/lora_slots.py), so a row's delta lands where its base output does."""
    rules = rules_for(config, mesh.shape[TP_AXIS], mesh.shape.get(EP_AXIS, 1))
    shardings = tuple(
        LayerSlots(*({name: NamedSharding(mesh, spec_for(a, rules)) for name, a in part.items()}
                     for part in lora_axes(config, layer)))
        for layer in range(len(weights))
    )
    return jax.device_put(weights, shardings)
