"""LoRA adapters in PEFT's format, read from a directory and checked against the base model.

A PEFT LoRA directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, for every adapted matrix ``W
[out, in]`` of layer ``i``, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
[r, in]`` and ``...lora_B.weight [out, r]``. The adapted model computes ``x W^T + scale * (x
A^T) B^T`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), which is
what ``merge_and_unload`` bakes into ``W``.

Everything an adapter may not do here is refused at load with the reason, before any of it
reaches a device: other targets than the seven projections of a decoder layer, ``modules_to_save``
(whole replaced matrices), DoRA, trained biases, per-module rank or alpha patterns, a rank above
the replica's ``max_lora_rank``, shapes that are not the base model's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
from safetensors import SafetensorError, safe_open

from raylm.model.config.model_config import ModelConfig
from raylm.model.errors import LoraAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class Target(NamedTuple):
    """A matrix an adapter may adapt: its HF module (``self_attn.q_proj``), and its input and
    output dims in the layout of the replica's adapter slots (``model/decoder/lora_slots.py``), each
    with its logical axis name (model/runtime/sharding.py splits them as it splits the base matrix's):
    q/k/v outputs grouped by KV head as the fused QKV is, ``wo``'s input as ``[heads, head_dim]``."""

    module: str
    in_shape: Callable[[ModelConfig], tuple[int, ...]]
    in_axes: tuple[str, ...]
    out_shape: Callable[[ModelConfig], tuple[int, ...]]
    out_axes: tuple[str, ...]


def _hidden(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


def _mlp(c: ModelConfig) -> tuple[int, ...]:
    return (c.intermediate_size,)


def _kv(c: ModelConfig) -> tuple[int, ...]:
    return (c.num_kv_heads, c.head_dim)


TARGETS: dict[str, Target] = {
    "q_proj": Target("self_attn.q_proj", _hidden, ("embed",), lambda c: (c.num_kv_heads, c.q_per_kv, c.head_dim),
                     ("kv_heads", "qkv", "head_dim")),
    "k_proj": Target("self_attn.k_proj", _hidden, ("embed",), _kv, ("kv_heads", "head_dim")),
    "v_proj": Target("self_attn.v_proj", _hidden, ("embed",), _kv, ("kv_heads", "head_dim")),
    "o_proj": Target("self_attn.o_proj", lambda c: (c.num_heads, c.head_dim), ("heads", "head_dim"), _hidden,
                     ("embed",)),
    "gate_proj": Target("mlp.gate_proj", _hidden, ("embed",), _mlp, ("mlp",)),
    "up_proj": Target("mlp.up_proj", _hidden, ("embed",), _mlp, ("mlp",)),
    "down_proj": Target("mlp.down_proj", _mlp, ("mlp",), _hidden, ("embed",)),
}


def layer_targets(config: ModelConfig, layer: int) -> list[str]:
    """The targets an adapter may adapt in ``layer``: all seven, but only the attention ones in a
    mixture-of-experts layer (LoRA on expert MLPs is not supported)."""
    return [name for name in TARGETS if not (config.is_sparse(layer) and TARGETS[name].module.startswith("mlp."))]


_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter as host arrays: for each adapted (layer, target) its ``A [r, in...]`` and its
    ``B^T [r, out...]`` already multiplied by the scale, both float32 in the slot layout."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.weights})

    def layer_slice(self, start: int, stop: int) -> "LoraAdapter":
        """The adapter of decoder layers ``[start, stop)`` alone, numbered from 0 (a pipeline
        stage's part, for ``ModelConfig.layer_slice``)."""
        weights = {(layer - start, target): pair for (layer, target), pair in self.weights.items()
                   if start <= layer < stop}
        return dataclasses.replace(self, weights=weights)


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter in directory ``path`` for a base model of ``config``; raises
    ``LoraAdapterError`` naming the problem."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    settings = _read_config(path / CONFIG_FILE, where)
    rank, scale = _rank_and_scale(settings, where, max_rank)
    tensors = _read_tensors(path / WEIGHTS_FILE, where)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    unknown = []
    for key, array in tensors.items():
        match = _KEY.fullmatch(key)
        target = match and TARGETS.get(match.group(3))
        if not target or target.module != f"{match.group(2)}.{match.group(3)}":
            unknown.append(key)
            continue
        pairs.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = array
    if unknown:
        raise LoraAdapterError(f"{where}: tensors of modules raylm cannot adapt: {sorted(unknown)[:6]} (LoRA applies "
                               f"to a decoder layer's {', '.join(TARGETS)})")
    if not pairs:
        raise LoraAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    weights = {}
    for (layer, target), pair in sorted(pairs.items()):
        label = f"{where}: layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"{label} has lora_{''.join(pair)} without lora_{'B' if 'A' in pair else 'A'}")
        if layer >= config.num_layers:
            raise LoraAdapterError(f"{label}: the base model has {config.num_layers} layers")
        if target not in layer_targets(config, layer):
            raise LoraAdapterError(f"{label}: that layer of the base model is a mixture of experts "
                                   "(LoRA on expert MLPs is not supported; attention targets are)")
        weights[(layer, target)] = _slot_layout(pair["A"], pair["B"], TARGETS[target], config, rank, scale, label)
    return LoraAdapter(name, str(path), rank, scale, weights)


def _read_config(file: Path, where: str) -> dict[str, Any]:
    try:
        settings = json.loads(file.read_text())
    except OSError as err:
        raise LoraAdapterError(f"{where}: cannot read {file.name}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise LoraAdapterError(f"{where}: {file.name} is not valid JSON: {err}") from None
    if not isinstance(settings, dict):
        raise LoraAdapterError(f"{where}: {file.name} must hold a JSON object")
    refused = []
    if settings.get("peft_type", "LORA") != "LORA":
        refused.append(f"peft_type {settings['peft_type']!r} (only LORA)")
    if settings.get("modules_to_save"):
        refused.append(f"modules_to_save {settings['modules_to_save']} (whole replaced matrices)")
    if settings.get("use_dora"):
        refused.append("use_dora (DoRA)")
    if settings.get("bias", "none") != "none":
        refused.append(f"bias {settings['bias']!r} (trained biases)")
    if settings.get("fan_in_fan_out"):
        refused.append("fan_in_fan_out")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if settings.get(pattern):
            refused.append(f"{pattern} (one rank and alpha for every module)")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            refused.append(f"target_modules {unknown} (LoRA applies to {', '.join(TARGETS)})")
    if refused:
        raise LoraAdapterError(f"{where}: not supported: " + "; ".join(refused))
    return settings


def _rank_and_scale(settings: dict[str, Any], where: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: rank {rank} exceeds the replica's max_lora_rank {max_rank}; "
                               "raise engine.max_lora_rank")
    return rank, float(alpha) / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _read_tensors(file: Path, where: str) -> dict[str, np.ndarray]:
    if not file.is_file():
        raise LoraAdapterError(f"{where}: {file.name} is missing")
    try:
        with safe_open(str(file), framework="numpy") as handle:
            return {key: handle.get_tensor(key).astype(np.float32) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise LoraAdapterError(f"{where}: cannot read {file.name}: {err}") from None


def _slot_layout(a: np.ndarray, b: np.ndarray, target: Target, config: ModelConfig, rank: int, scale: float,
                 label: str) -> tuple[np.ndarray, np.ndarray]:
    """``A [r, in]`` and ``B [out, r]`` as PEFT stores them -> ``A [r, in...]`` and ``scale * B^T
    [r, out...]`` in the slot layout; shapes checked against the base model."""
    in_shape, out_shape = target.in_shape(config), target.out_shape(config)
    expected = ((rank, math.prod(in_shape)), (math.prod(out_shape), rank))
    if (a.shape, b.shape) != expected:
        raise LoraAdapterError(f"{label}: lora_A {a.shape} and lora_B {b.shape}, expected {expected[0]} and "
                               f"{expected[1]} (rank {rank} for this base model)")
    return a.reshape(rank, *in_shape), (b.T * np.float32(scale)).reshape(rank, *out_shape)
