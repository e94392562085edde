"""DeepSeek-style expert routing, as HF's DeepseekV2 / DeepseekV3 (Kimi K2 too) and GLM-4.5
(Glm4Moe) read it from config.json: the router's scores (softmax or sigmoid of float32
logits), optionally a per-expert correction bias that steers which experts are chosen but
not their weights (V3's ``noaux_tc``), a choice limited to the ``topk_group`` best of
``n_group`` expert groups, ``norm_topk_prob`` and ``routed_scaling_factor``; and the rest of
their MoE block: ``n_shared_experts`` experts' worth of one ungated dense MLP beside the routed
ones, and the first ``first_k_dense_replace`` layers dense (with ``intermediate_size``).

Each family's HF modeling code fixes part of this whatever config.json says (V3 and GLM always
score by sigmoid with the bias and group by their two best scores; V2 always softmaxes and
never renormalizes): a config that states otherwise is a load error naming the key, as is
anything else here HF does not read. model/decoder/deepseek_routing.py computes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raylm.model.errors import UnsupportedModelError

SCORINGS = ("softmax", "sigmoid")
# How a group of experts is scored for the group-limited choice: its best expert's score (V2's
# group_limited_greedy) or the sum of its two best (V3's noaux_tc).
GROUP_SCORES = ("max", "top2_sum")


@dataclasses.dataclass(frozen=True)
class DeepseekRouting:
    """How a token's experts and their weights follow from the router's logits."""

    scoring: str  # softmax over all experts, or each expert's sigmoid
    score_correction: bool  # a per-expert bias (``e_score_correction_bias``) added to choose, not to weigh
    num_groups: int = 1  # experts split into this many equal groups (n_group) ...
    groups_used: int = 1  # ... of which the best this many (topk_group) may be chosen from
    group_score: str = "max"
    scaling_factor: float = 1.0  # the chosen weights times this (routed_scaling_factor)

    def __post_init__(self) -> None:
        assert self.scoring in SCORINGS and self.group_score in GROUP_SCORES, self

    def check(self, num_experts: int, top_k: int, source: str) -> None:
        """Refuses a grouping that cannot route ``top_k`` of ``num_experts`` experts."""
        groups, used = self.num_groups, self.groups_used
        if groups < 1 or num_experts % groups:
            raise UnsupportedModelError(f"n_group={groups} in {source} must divide n_routed_experts={num_experts}")
        if not 1 <= used <= groups:
            raise UnsupportedModelError(f"topk_group={used} in {source} must be between 1 and n_group={groups}")
        per_group = num_experts // groups
        if self.group_score == "top2_sum" and groups > 1 and per_group < 2:
            raise UnsupportedModelError(f"n_group={groups} in {source} leaves fewer than 2 experts per group")
        if top_k > used * per_group:
            raise UnsupportedModelError(
                f"num_experts_per_tok={top_k} in {source} exceeds the {used * per_group} experts of "
                f"topk_group={used} groups"
            )


@dataclasses.dataclass(frozen=True)
class _HfRouter:
    """What one HF family's router fixes, and its config class's defaults."""

    scoring: str
    score_correction: bool
    topk_methods: tuple[str, ...]  # the topk_method values it implements (the first: the default)
    reads_norm_topk_prob: bool
    defaults: Mapping[str, Any]


_V3_LIKE = dict(scoring="sigmoid", score_correction=True, topk_methods=("noaux_tc",), reads_norm_topk_prob=True)
HF_ROUTERS: dict[str, _HfRouter] = {
    "deepseek_v2": _HfRouter(
        scoring="softmax", score_correction=False, topk_methods=("greedy", "group_limited_greedy"),
        reads_norm_topk_prob=False,
        defaults=dict(n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0, n_group=None,
                      topk_group=None, norm_topk_prob=False)),
    "deepseek_v3": _HfRouter(**_V3_LIKE, defaults=dict(
        n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4,
        norm_topk_prob=True)),
    "glm4_moe": _HfRouter(**_V3_LIKE, defaults=dict(
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        norm_topk_prob=True)),
}
# The config keys read here (model/config/moe.py refuses them for the other families).
KEYS = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
        "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob")


@dataclasses.dataclass(frozen=True)
class DeepseekMoe:
    """The MoE block such a config describes, beside its expert count, size and top-k."""

    routing: DeepseekRouting
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_size: int  # the ungated shared MLP's intermediate size (0: none)


def sparse_layers_from_hf(raw: Mapping[str, Any], router: str, num_layers: int) -> tuple[bool, ...]:
    """Per layer: experts (from ``first_k_dense_replace`` on, HF family ``router``'s default when
    config.json omits it) or a dense MLP."""
    dense = raw.get("first_k_dense_replace", HF_ROUTERS[router].defaults["first_k_dense_replace"])
    return tuple(i >= int(dense or 0) for i in range(num_layers))


def deepseek_moe_from_hf(
    raw: Mapping[str, Any], router: str, num_experts: int, expert_size: int, top_k: int, num_layers: int,
    source: str,
) -> DeepseekMoe:
    """Read the routing of HF family ``router`` (a key of ``HF_ROUTERS``) from ``raw``."""
    hf = HF_ROUTERS[router]
    values = {key: raw.get(key, default) for key, default in hf.defaults.items()}
    scoring = raw.get("scoring_func") or hf.scoring
    if scoring != hf.scoring:
        raise UnsupportedModelError(f"scoring_func={scoring!r} in {source}: HF's {router} scores by {hf.scoring}")
    method = raw.get("topk_method") or hf.topk_methods[0]
    if method not in hf.topk_methods:
        raise UnsupportedModelError(
            f"topk_method={method!r} in {source}: HF's {router} implements {', '.join(hf.topk_methods)}"
        )
    norm = bool(values["norm_topk_prob"])
    if norm and not hf.reads_norm_topk_prob:
        raise UnsupportedModelError(
            f"norm_topk_prob=true in {source}: HF's {router} does not renormalize the top-k weights (its original "
            "code does); raylm follows neither silently"
        )
    grouped = method != "greedy"
    routing = DeepseekRouting(
        scoring=scoring,
        score_correction=hf.score_correction,
        num_groups=int(values["n_group"] or 1) if grouped else 1,
        groups_used=int(values["topk_group"] or 1) if grouped else 1,
        group_score="top2_sum" if method == "noaux_tc" else "max",
        scaling_factor=float(values["routed_scaling_factor"]),
    )
    routing.check(num_experts, top_k, source)
    freq = raw.get("moe_layer_freq")
    if freq not in (None, 1):
        raise UnsupportedModelError(f"moe_layer_freq={freq!r} in {source}: HF makes every layer past "
                                    "first_k_dense_replace sparse (moe_layer_freq 1)")
    return DeepseekMoe(
        routing=routing,
        norm_topk_prob=norm,
        sparse_layers=sparse_layers_from_hf(raw, router, num_layers),
        shared_expert_size=int(values["n_shared_experts"] or 0) * expert_size,
    )


# llama.cpp's architectures with this routing, and the scoring each falls back to without
# expert_gating_func (src/llama-model.cpp): glm4moe sigmoid, deepseek2 softmax (the V2 / V2.5
# files that predate the key; V3's converter writes sigmoid). build_moe_ffn groups by the two
# best scores (expert_group_count, read for every architecture), renormalizes with
# expert_weights_norm and scales by expert_weights_scale. glm4moe always has the exp_probs_b
# correction bias; deepseek2 only where the file holds it (V3's), ``OPTIONAL_SCORE_BIAS``.
GGUF_ARCHES: dict[str, str] = {"glm4moe": "sigmoid", "deepseek2": "softmax"}
OPTIONAL_SCORE_BIAS = ("deepseek2",)
# Their keys that this reads (model/config/gguf_metadata.py refuses them for the others).
GGUF_KEYS = ("expert_gating_func", "expert_weights_scale", "expert_group_count", "expert_group_used_count",
             "leading_dense_block_count", "nextn_predict_layers")
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}  # LLAMA_EXPERT_GATING_FUNC_TYPE_*


def deepseek_moe_from_gguf(meta: Any, num_experts: int, expert_size: int, top_k: int, num_layers: int) -> DeepseekMoe:
    """The routing a GGUF's metadata (a ``gguf_metadata.GgufMetadata``) states, read as llama.cpp reads it."""
    gating = meta.get("expert_gating_func")
    scoring = GGUF_ARCHES[meta.arch] if gating in (None, 0) else _GGUF_GATING.get(int(gating))
    if scoring is None:
        raise meta.refuse("expert_gating_func", "is not a gating raylm implements (1 softmax, 2 sigmoid)")
    scale = float(meta.get("expert_weights_scale") or 0.0)
    groups = int(meta.get("expert_group_count") or 0)
    routing = DeepseekRouting(
        scoring=scoring,
        score_correction=True,
        num_groups=max(groups, 1),
        groups_used=int(meta.get("expert_group_used_count") or 0) if groups > 1 else 1,
        group_score="top2_sum",
        scaling_factor=1.0 if scale == 0.0 else scale,  # (llama.cpp: 0, unset, means no scaling)
    )
    routing.check(num_experts, top_k, meta.source)
    dense = int(meta.get("leading_dense_block_count") or 0)
    return DeepseekMoe(
        routing=routing,
        norm_topk_prob=bool(meta.get("expert_weights_norm") or False),
        sparse_layers=tuple(i >= dense for i in range(num_layers)),
        shared_expert_size=int(meta.get("expert_shared_count") or 0) * expert_size,
    )
