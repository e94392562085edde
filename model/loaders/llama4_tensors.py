"""An HF Llama 4 text checkpoint's tensors under the names and layouts ``build_params`` asks for.

Llama 4 names its MLPs ``feed_forward`` (router, shared expert, dense layers' projections),
stores each sparse layer's experts as two stacked tensors, ``experts.gate_up_proj [E, D, 2I]``
(inputs first, gate then up along the last axis) and ``experts.down_proj [E, I, D]``, and
rotates q/k as adjacent pairs (complex RoPE). Here the experts are answered as the stacked
``[E, out, in]`` arrays ``stacked_experts`` reads (model/loaders/fused_experts.py), and q/k rows are reordered per head into
rotate-half halves: the same reordering that undoes llama.cpp's permutation, which changes
no q.k product (model/config/llama4.py).
"""

from __future__ import annotations

import re

from raylm.model.config.model_config import ModelConfig
from raylm.model.loaders.fused_experts import fused_expert_projection
from raylm.model.loaders.gguf_checkpoint import unpermute_qk
from raylm.model.loaders.hf_tensors import TensorSource, map_rows

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def llama4_tensors(get: TensorSource, config: ModelConfig) -> TensorSource:
    """``get`` (an HF Llama 4 checkpoint's tensors by their own names) answering the names of
    the Llama layout (``mlp.*``, stacked ``mlp.experts.{gate,up,down}_proj``)."""
    heads = {"self_attn.q_proj.weight": config.num_heads, "self_attn.k_proj.weight": config.num_kv_heads}
    expert_size = config.moe.expert_size if config.moe is not None else 0

    def answer(name: str):
        match = _LAYER_RE.fullmatch(name)
        if match is None:
            return get(name)
        layer, field = match.groups()
        prefix = f"model.layers.{layer}.feed_forward."
        if field in heads:
            found = get(name)
            return None if found is None else map_rows(lambda a: unpermute_qk(a, heads[field]), found)
        if field == "mlp.gate.weight":
            return get(prefix + "router.weight")
        if field.startswith("mlp.experts."):
            return fused_expert_projection(get, prefix, field.split(".")[2], config.hidden_size, expert_size)
        if field.startswith("mlp."):
            return get(prefix + field[len("mlp."):])
        return get(name)

    return answer
