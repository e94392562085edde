"""DeepSeek-style routing (model/config/deepseek_routing.py), computed as HF's
DeepseekV2TopkRouter, DeepseekV3TopkRouter and Glm4MoeTopkRouter do.

The router's logits are computed in float32 from float32 casts of the hidden states and the
router weight (HF's ``F.linear(h.float(), w.float())``, whatever the model dtype); scored by a
softmax or per-expert sigmoids; the correction bias (float32) is added for choosing only; with
groups, each group is scored (its best score, or its two best summed) and only the
``groups_used`` best groups' experts stay candidates (the others masked to -inf: the
config's check guarantees ``top_k`` candidates remain, so this picks what HF's mask to 0 or
-inf picks); the ``top_k`` best candidates are the experts, their unbiased scores the weights,
renormalized with ``norm_topk_prob`` (HF's ``sum + 1e-20``) and times the scaling factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from raylm.model.config.moe import MoeConfig
from raylm.model.kernels.dense import dense


def deepseek_route(
    h: jax.Array, router: jax.Array, score_bias: jax.Array | None, moe: MoeConfig, *, kernel: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``(experts [T, k] int32, weights [T, k] float32)`` of tokens ``h [T, D]`` by the router
    ``[E, D]`` and, where the routing has one (``score_correction``), the correction bias ``[E]``."""
    routing = moe.deepseek
    assert routing is not None
    logits = dense(h.astype(jnp.float32), router.astype(jnp.float32), kernel=kernel)
    if routing.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores + score_bias.astype(jnp.float32) if routing.score_correction else scores
    if routing.num_groups > 1:
        choice = _best_groups_only(choice, routing.num_groups, routing.groups_used, routing.group_score)
    _, experts = jax.lax.top_k(choice, moe.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * jnp.float32(routing.scaling_factor)


def _best_groups_only(choice: jax.Array, groups: int, used: int, group_score: str) -> jax.Array:
    """``choice [T, E]`` with every expert outside its token's ``used`` best groups at -inf."""
    T, E = choice.shape
    grouped = choice.reshape(T, groups, E // groups)
    if group_score == "max":
        scores = jnp.max(grouped, axis=-1)
    else:  # top2_sum
        scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(scores, used)  # [T, used]
    keep = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)  # [T, groups]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(T, E)
