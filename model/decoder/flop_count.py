"""The arithmetic of a forward pass, counted from the model's shapes: what "achieved GFLOP/s"
divides by.

A token's work is its matrix products and its attention. For the matrices, each multiply-add
counts as 2 operations over every weight the token passes through: the decoder layers'
dense matrices as the config declares them (``model.decoder.params``: fused QKV, output, gate/up,
down), of a mixture of experts only the ``top_k`` experts it is routed to (with the router's
``[E, D]`` logits matrix, and a shared expert with its ``[1, D]`` gate), and the LM head's
``[V, D]`` only for the rows whose logits are computed (a prompt chunk's last token, every
decode and verify position). Attention adds, per layer, ``4 x heads x head_dim`` per key the
token reads (``q . k`` and the weighted sum of ``v``: 2 each), the keys being its own
position and those before it, or its window's on a sliding layer. DeepSeek's latent attention
counts its absorbed form (model/decoder/latent_attention.py), one KV head of ``kv_lora_rank +
qk_rope_head_dim`` read by every head: ``2 x heads x (kv_lora_rank + qk_rope_head_dim)`` per key for
the scores and ``2 x heads x kv_lora_rank`` for the latent values.

Not counted: norms, rotary embeddings, activations, softmax, routing's top-k and sampling
(element-wise, noise beside the matrices), LoRA deltas, and the padding rows and keys of the
shape buckets (the count is the useful work, so padding shows as a lower rate). Storage does
not change the count: a Q4_1 or int8 matrix does the same multiply-adds as its float32
expansion.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.params import LAYER_INFO, LAYER_MATRIX_INPUT_DIMS, MODEL_INFO, ModelParams

_EXPERTS = frozenset({"w_experts_gate_up", "w_experts_down"})  # stacked [E, ...]: a token uses top_k of them


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """A model's operations per token, derived once from its config and which weights it has."""

    matrix_params: int  # weights a token multiplies in the decoder layers (active experts only)
    head_params: int  # the LM head's, for each row whose logits are computed
    # (window or None for full attention, 4 x heads x head_dim summed over the layers with it)
    attention: tuple[tuple[int | None, int], ...]

    @classmethod
    def of(cls, config: ModelConfig, params: ModelParams) -> ModelFlops:
        """Count from ``config``'s shapes the matrices ``params`` holds (a layer has a dense MLP
        or experts, a shared expert or not); the storage format of each does not matter."""
        matrix = 0
        for layer in params.layers:
            for name in LAYER_MATRIX_INPUT_DIMS:
                if getattr(layer, name) is None:
                    continue
                size = math.prod(LAYER_INFO[name].shape(config))
                matrix += size // config.moe.num_experts * config.moe.top_k if name in _EXPERTS else size
            for vector in ("router", "shared_gate"):  # matrices not marked as such: kept unquantized
                if getattr(layer, vector) is not None:
                    matrix += math.prod(LAYER_INFO[vector].shape(config))
        mla = config.mla
        per_layer = 4 * config.num_heads * config.head_dim if mla is None else \
            2 * config.num_heads * (mla.latent_dim + mla.kv_lora_rank)
        windows = Counter(config.layer_window(i) for i in range(config.num_layers))
        return cls(matrix, math.prod(MODEL_INFO["embed"].shape(config)),
                   tuple((window, per_layer * n) for window, n in windows.items()))

    def flops(self, logit_rows: int, starts: np.ndarray, counts: np.ndarray) -> int:
        """Operations of a forward pass over runs of one sequence's consecutive tokens: run ``i``
        computes the ``counts[i]`` positions from ``starts[i]`` on (each reading the keys up to its
        own), and ``logit_rows`` rows of them compute logits."""
        starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
        tokens = int(counts.sum())
        # Run i's tokens read first = starts + 1 .. last = starts + counts keys (before any window).
        first, last = starts + 1, starts + counts
        attention = sum(per_key * _keys_read(first, last, window) for window, per_key in self.attention)
        return 2 * (self.matrix_params * tokens + self.head_params * logit_rows) + attention


def _keys_read(first: np.ndarray, last: np.ndarray, window: int | None) -> int:
    """``sum over runs of sum_{c = first}^{last} min(c, window)``: the keys the tokens of runs
    whose key counts go from ``first`` to ``last`` read (empty runs, ``last < first``, read none)."""
    last = np.maximum(last, first - 1)
    if window is None:
        return int(np.sum((first + last) * (last - first + 1) // 2))
    below = np.minimum(last, window)  # the counts under the window run first..below, the rest see all of it
    inside = np.where(below >= first, (first + below) * (below - first + 1) // 2, 0)
    beyond = (last - np.maximum(first - 1, below)) * window
    return int(np.sum(inside + beyond))
