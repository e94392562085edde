"""The mixture-of-experts block of a config: how many experts, how tokens are routed to them,
which layers have them. Read from an HF ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, GLM-4.5, DeepSeek V2/V3) or from GGUF metadata (llama with experts, qwen2moe, qwen3moe,
olmoe, glm4moe, deepseek2, gpt-oss; llama4's: model/config/llama4.py), as HF and llama.cpp read them.

Most families route the same way (HF's TopKRouter): the router's logits go through a
softmax over all experts, the ``top_k`` largest probabilities pick the experts, and with
``norm_topk_prob`` the picked probabilities are divided by their sum (Mixtral always: its
softmax-over-the-top-k is the same numbers; gpt-oss too, whose router's logits carry a
bias: model/config/expert_mlp.py). The DeepSeek-style families (GLM-4.5, DeepSeek
V2/V3) route as model/config/deepseek_routing.py reads
(sigmoid scores, grouped top-k, a score-correction bias, a scaling factor, ungated shared
experts, leading dense layers). Any other routing (capacity limits,
expert-choice) is a load error naming the key, except Llama 4's own
(model/config/llama4.py: ``sigmoid_scales_input``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raylm.model.config.deepseek_routing import GGUF_ARCHES as DEEPSEEK_GGUF_ARCHES
from raylm.model.config.deepseek_routing import KEYS as DEEPSEEK_KEYS
from raylm.model.config.deepseek_routing import (
    DeepseekMoe,
    DeepseekRouting,
    deepseek_moe_from_gguf,
    deepseek_moe_from_hf,
    sparse_layers_from_hf,
)
from raylm.model.config.expert_mlp import ClampedSwiglu, clamped_swiglu_from_hf
from raylm.model.config.families import Family
from raylm.model.errors import ModelLoadError, UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The experts of a model's sparse layers (the other layers keep a dense MLP)."""

    num_experts: int
    top_k: int  # experts each token is routed to
    expert_size: int  # intermediate size of each expert's gated MLP
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    shared_expert_size: int = 0  # a dense MLP beside the experts (Qwen2-MoE's gated by sigmoid(x . w))
    shared_expert_gated: bool = True  # False: the shared MLP's output is added as is (DeepSeek, GLM, Llama 4)
    deepseek: DeepseekRouting | None = None  # DeepSeek-style routing in place of HF's TopKRouter
    # Llama 4: the top-k router logits through a sigmoid scale each expert's input (not its output).
    sigmoid_scales_input: bool = False
    # gpt-oss (model/config/expert_mlp.py): biases on the router and on each expert's
    # projections, and the clamped SwiGLU in place of the config's activation.
    router_bias: bool = False
    expert_bias: bool = False
    clamped_swiglu: ClampedSwiglu | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be between 1 and the expert count {self.num_experts}"
            )

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


# Config keys of routing variants HF or other families define and raylm does not implement,
# with the value that means "off" (None: refused whatever the value). The DeepSeek-style
# families read the DeepSeek keys among them (model/config/deepseek_routing.py).
_UNIMPLEMENTED_HF: dict[str, Any] = {
    "scoring_func": "softmax",  # DeepSeek-V3's sigmoid scores
    "topk_method": "greedy",  # grouped / noaux top-k
    "n_group": None,
    "topk_group": None,
    "routed_scaling_factor": 1.0,
    "capacity_factor": None,
    "expert_capacity": None,
    "moe_router_bias": None,
    "router_bias": False,
    "n_shared_experts": None,
    "first_k_dense_replace": None,
    "moe_layer_freq": None,
}


def moe_from_hf(raw: Mapping[str, Any], family: Family, num_layers: int, source: str) -> MoeConfig | None:
    """The MoE block an HF config describes for ``family`` (None for a dense family)."""
    keys = family.moe
    if keys is None:
        return None
    for key, off in _UNIMPLEMENTED_HF.items():
        if keys.deepseek is not None and key in DEEPSEEK_KEYS:
            continue  # read below
        if raw.get(key) is not None and (off is None or raw[key] != off):
            raise UnsupportedModelError(f"{key}={raw[key]!r} in {source}: raylm does not implement this MoE routing")
    if keys.deepseek is not None and not any(sparse_layers_from_hf(raw, keys.deepseek, num_layers)):
        return None  # (first_k_dense_replace covers every layer: HF builds a dense MLP on each)
    try:
        # (transformers 5 writes Qwen3-MoE's num_experts under its alias num_local_experts.)
        experts = int(raw[keys.count] if keys.count in raw else raw["num_local_experts"])
        size = int(raw[keys.size])
        top_k = int(raw["num_experts_per_tok"])
    except KeyError as missing:
        raise ModelLoadError(f"{source} lacks required key {missing}") from None
    if keys.deepseek is not None:
        block = deepseek_moe_from_hf(raw, keys.deepseek, experts, size, top_k, num_layers, source)
        return _deepseek_config(block, experts, size, top_k, source)
    sparse = [experts > 0] * num_layers
    if keys.sparse_step:  # every decoder_sparse_step-th layer, less mlp_only_layers
        step = int(raw.get("decoder_sparse_step") or 1)
        dense_only = set(raw.get("mlp_only_layers") or ())
        sparse = [experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(sparse):
        raise UnsupportedModelError(f"{source}: no layer has experts; serve this model as its dense family")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_size=size,
        norm_topk_prob=keys.always_norm_topk or bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(sparse),
        shared_expert_size=int(raw.get("shared_expert_intermediate_size") or 0) if keys.shared_expert else 0,
        router_bias=keys.gpt_oss_experts,
        expert_bias=keys.gpt_oss_experts,
        clamped_swiglu=clamped_swiglu_from_hf(raw, source) if keys.gpt_oss_experts else None,
    )


def _deepseek_config(block: DeepseekMoe, experts: int, size: int, top_k: int, source: str) -> MoeConfig | None:
    """The MoeConfig of a DeepSeek-style block (model/config/deepseek_routing.py); None when the
    leading dense layers (a GGUF's ``leading_dense_block_count``) are all of them."""
    if not any(block.sparse_layers):
        return None
    if experts < 1:
        raise UnsupportedModelError(f"{source}: n_routed_experts={experts} leaves the sparse layers no experts")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_size=size,
        norm_topk_prob=block.norm_topk_prob,
        sparse_layers=block.sparse_layers,
        shared_expert_size=block.shared_expert_size,
        shared_expert_gated=False,
        deepseek=block.routing,
    )


# llama.cpp's per-arch choice of renormalizing the top-k (build_moe_ffn's norm_w): Mixtral
# (llama) and Qwen3-MoE do, Qwen2-MoE and OLMoE do not. A file's expert_weights_norm wins.
_GGUF_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}


def moe_from_gguf(meta: Any, num_layers: int, dense_size: int) -> MoeConfig | None:
    """The MoE block a GGUF's metadata (a ``gguf_metadata.GgufMetadata``) states, or None.
    llama.cpp makes every layer of these architectures sparse, except the DeepSeek-style ones'
    leading dense layers (model/config/deepseek_routing.py)."""
    experts = int(meta.get("expert_count", 0) or 0)
    if experts == 0:
        if meta.arch in ("qwen2moe", "qwen3moe", "olmoe", *DEEPSEEK_GGUF_ARCHES):
            raise ModelLoadError(f"{meta.source}: a {meta.arch} file without {meta.arch}.expert_count")
        return None
    if meta.arch in DEEPSEEK_GGUF_ARCHES:
        size = int(meta.get("expert_feed_forward_length", required=True))
        top_k = int(meta.get("expert_used_count", required=True))
        block = deepseek_moe_from_gguf(meta, experts, size, top_k, num_layers)
        return _deepseek_config(block, experts, size, top_k, meta.source)
    if meta.arch == "gpt-oss":  # llama.cpp: softmax over the top-k biased logits, its fixed clamped SwiGLU
        return MoeConfig(
            num_experts=experts, top_k=int(meta.get("expert_used_count", required=True)),
            expert_size=int(meta.get("expert_feed_forward_length", required=True)), norm_topk_prob=True,
            sparse_layers=(True,) * num_layers, router_bias=True, expert_bias=True, clamped_swiglu=ClampedSwiglu(),
        )
    if meta.arch not in _GGUF_NORM_TOPK:
        raise meta.refuse("expert_count", "(experts) is not implemented by raylm for this architecture")
    if meta.has("expert_shared_count"):
        raise meta.refuse("expert_shared_count", f"(DeepSeek-style shared experts) is not read for {meta.arch}")
    shared = int(meta.get("expert_shared_feed_forward_length", 0) or 0)
    if shared and meta.arch != "qwen2moe":
        raise meta.refuse("expert_shared_feed_forward_length", "(shared experts) is read for qwen2moe only")
    norm = meta.get("expert_weights_norm")
    return MoeConfig(
        num_experts=experts,
        top_k=int(meta.get("expert_used_count", required=True)),
        expert_size=int(meta.get("expert_feed_forward_length") or dense_size),
        norm_topk_prob=_GGUF_NORM_TOPK[meta.arch] if norm is None else bool(norm),
        sparse_layers=(True,) * num_layers,
        shared_expert_size=shared,
    )
