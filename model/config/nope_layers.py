"""Layers without RoPE (NoPE), as HF's SmolLM3 and Llama 4 configs declare them.

Both read ``no_rope_layers`` (one flag per layer, 1: the layer rotates) or, without it, rotate
every layer except each ``no_rope_layer_interval``-th (default 4); llama.cpp fixes the interval
at 4 for its ``smollm3`` and ``llama4`` files. A NoPE layer attends by content alone; its keys
are stored unrotated.
"""

from __future__ import annotations

from typing import Any, Mapping

from raylm.model.errors import ModelLoadError

GGUF_NOPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step


def every_nth_nope(num_layers: int, interval: int) -> tuple[bool, ...]:
    """Per layer: no RoPE on each ``interval``-th layer (the last of every ``interval``)."""
    return tuple((i + 1) % interval == 0 for i in range(num_layers))


def nope_layers_from_hf(raw: Mapping[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it skips RoPE, as HF's configs derive it."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        return every_nth_nope(num_layers, int(raw.get("no_rope_layer_interval") or GGUF_NOPE_INTERVAL))
    if len(flags) < num_layers:
        raise ModelLoadError(f"no_rope_layers in {source} lists {len(flags)} layers, the model has {num_layers}")
    return tuple(not flag for flag in flags[:num_layers])
