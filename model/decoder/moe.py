"""A mixture-of-experts block: route each token to its top-k experts, run only those.

The step's (token, k) pairs are sorted by expert, so each expert's rows are one contiguous
group; one grouped matmul over the stacked expert weights (model/kernels/grouped_matmul.py) runs
every group against its own expert (gate/up, then down), and the rows go back to their
tokens, weighted by the router and summed. Shapes are static: ``tokens * top_k`` rows
whatever the routing; how many rows each expert gets travels as data (``group_sizes``). Experts
split over devices run this per device on its own experts (model/decoder/expert_parallel.py).

Routing is HF's TopKRouter (model/config/moe.py): softmax over the router's logits in
float32, the top-k probabilities, divided by their sum with ``norm_topk_prob``; or DeepSeek's
(model/decoder/deepseek_routing.py) where the config declares it; or Llama 4's
(``route_sigmoid_input``): a sigmoid of the top-k logits, scaling each expert's input.

A step's padding tokens (``valid`` False) are routed to no expert: their rows sort past every
group, which the grouped kernel skips (their output is zero), so a decode bucket's padding
costs no expert work, and the per-expert row counts are the real tokens' (the load metric,
``moe_block``'s second result).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from raylm.model.config.expert_mlp import ClampedSwiglu
from raylm.model.config.moe import MoeConfig
from raylm.model.decoder.deepseek_routing import deepseek_route
from raylm.model.decoder.expert_mlp import clamped_swiglu, expert_rows
from raylm.model.decoder.expert_parallel import experts_mesh, over_expert_shards
from raylm.model.decoder.layers import ACTIVATIONS, gated_mlp
from raylm.model.decoder.params import LayerParams
from raylm.model.kernels.dense import dense
from raylm.model.kernels.grouped_matmul import grouped_matmul


class Routing(NamedTuple):
    """Each token's experts and their weights."""

    experts: jax.Array  # [T, k] int32, most probable first
    weights: jax.Array  # [T, k] float32


def route(
    h: jax.Array, router: jax.Array, moe: MoeConfig, *, kernel: bool = False, bias: jax.Array | None = None
) -> Routing:
    """Top-k routing of tokens ``h [T, D]`` by the router ``[E, D]`` (plus its ``bias [E]``: gpt-oss)."""
    logits = dense(h, router, kernel=kernel)  # in the model dtype, as HF's F.linear
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights)


def route_sigmoid_input(h: jax.Array, router: jax.Array, moe: MoeConfig, *, kernel: bool = False) -> Routing:
    """Llama 4's routing: the top-k router logits, through a sigmoid in float32 and back to the
    model dtype as HF's Llama4Router gives them (the weights scale each expert's input)."""
    logits = dense(h, router, kernel=kernel)
    top, experts = jax.lax.top_k(logits, moe.top_k)
    weights = jax.nn.sigmoid(top.astype(jnp.float32)).astype(logits.dtype)
    return Routing(experts.astype(jnp.int32), weights)


def _routed(routing: Routing, num_experts: int, valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Each (token, k) pair's expert, ``num_experts`` (past every group) for a padding token's,
    and how many pairs each expert got ``[E]``."""
    flat = routing.experts.reshape(-1)
    if valid is not None:
        flat = jnp.where(jnp.repeat(valid.reshape(-1), routing.experts.shape[1]), flat, num_experts)
    return flat, jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)


def expert_mlps(
    h: jax.Array, routing: Routing, w_gate_up: jax.Array, w_down: jax.Array, activation: str, *, kernel: bool = False,
    valid: jax.Array | None = None, weights_scale_input: bool = False, b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None, swiglu: ClampedSwiglu | None = None, gpu_kernel: bool = False,
) -> jax.Array:
    """``sum_k weight[t, k] * expert[t, k](h[t])`` for tokens ``h [T, D]``, computing each
    token only through its own experts: gated MLPs with stacked weights ``w_gate_up [E, 2, I,
    D]`` and ``w_down [E, D, I]`` (``kernel``: see ``grouped_matmul``). Tokens where ``valid
    [T]`` is False get zeros, computed by no expert. With ``weights_scale_input`` (Llama 4)
    it is ``sum_k expert[t, k](weight[t, k] * h[t])``. gpt-oss (model/decoder/expert_mlp.py):
    biases ``b_gate_up [E, 2, I]`` and ``b_down [E, D]``, and ``swiglu`` in place of
    ``activation``. ``gpu_kernel``: the grouped matmuls by the Pallas kernel where lowered for a
    GPU (``grouped_matmul``).

    Experts split over a mesh's ``ep`` axis run per device (model/decoder/expert_parallel.py),
    each device's by the grouped kernel whatever ``kernel`` says: ``kernel`` is False for a
    sharded program only because XLA cannot partition the kernel, and inside the ``shard_map``
    there is nothing to partition (on another platform ``grouped_matmul`` still takes ragged_dot)."""

    def local(h: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array | None,
              stacks: tuple, kernel: bool = True) -> jax.Array:
        return _grouped_expert_mlps(h, Routing(experts, weights), *stacks, activation, kernel=kernel, valid=valid,
                                    weights_scale_input=weights_scale_input, swiglu=swiglu, gpu_kernel=gpu_kernel)

    stacks = (w_gate_up, w_down, b_gate_up, b_down)
    mesh = experts_mesh(w_gate_up)
    if mesh is not None:
        return over_expert_shards(mesh, local, h, routing.experts, routing.weights, valid, stacks,
                                  w_gate_up.shape[0])
    return local(h, routing.experts, routing.weights, valid, stacks, kernel)


def _grouped_expert_mlps(
    h: jax.Array, routing: Routing, w_gate_up: jax.Array, w_down: jax.Array, b_gate_up: jax.Array | None,
    b_down: jax.Array | None, activation: str, *, kernel: bool, valid: jax.Array | None, weights_scale_input: bool,
    swiglu: ClampedSwiglu | None, gpu_kernel: bool,
) -> jax.Array:
    """``expert_mlps`` over the experts of ``w_gate_up`` (all of them, or one device's: a pair
    routed to expert ``E`` or beyond, another device's, is computed by none, as a padding token)."""
    T, D = h.shape
    E = w_gate_up.shape[0]
    k = routing.experts.shape[1]
    flat, group_sizes = _routed(routing, E, valid)
    order = jnp.argsort(flat, stable=True)  # pair positions, grouped by expert (padding last)
    rows = h[order // k]  # [T*k, D]: each pair's token
    pair_weights = routing.weights.reshape(T * k)[order][:, None]
    if weights_scale_input:
        rows = rows * pair_weights.astype(rows.dtype)
    gate_up = grouped_matmul(rows, w_gate_up, group_sizes, kernel=kernel, gpu_kernel=gpu_kernel)  # [T*k, 2, I]
    if b_gate_up is not None:
        gate_up = gate_up + expert_rows(b_gate_up, flat[order])
    if swiglu is not None:
        hidden = clamped_swiglu(gate_up[:, 0], gate_up[:, 1], swiglu)
    else:
        hidden = ACTIVATIONS[activation](gate_up[:, 0]) * gate_up[:, 1]
    y = grouped_matmul(hidden, w_down, group_sizes, kernel=kernel, gpu_kernel=gpu_kernel)
    if b_down is not None:
        y = y + expert_rows(b_down, flat[order])
    if not weights_scale_input:
        y = y * pair_weights.astype(y.dtype)
    unsorted = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back to (token, k) order
    return jnp.sum(unsorted.reshape(T, k, D), axis=1)


def moe_block(
    x: jax.Array, lp: LayerParams, moe: MoeConfig, activation: str, *, kernel: bool = False,
    valid: jax.Array | None = None, gpu_kernel: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """A sparse layer's feed-forward for ``x [B, S, D]`` (already normed): the routed experts,
    plus the shared expert (Qwen2-MoE's scaled by ``sigmoid(x . shared_gate)``, DeepSeek's and Llama 4's
    as is); and the tokens routed to each expert ``[E]`` (int32), counting only those where
    ``valid [B, S]``. ``gpu_kernel``: see ``expert_mlps``."""
    B, S, D = x.shape
    h = x.reshape(B * S, D)
    if moe.deepseek is not None:
        routing = Routing(*deepseek_route(h, lp.router, lp.router_score_bias, moe, kernel=kernel))
    elif moe.sigmoid_scales_input:
        routing = route_sigmoid_input(h, lp.router, moe, kernel=kernel)
    else:
        routing = route(h, lp.router, moe, kernel=kernel, bias=lp.router_bias)
    flat_valid = None if valid is None else valid.reshape(B * S)
    out = expert_mlps(h, routing, lp.w_experts_gate_up, lp.w_experts_down, activation, kernel=kernel,
                      valid=flat_valid, weights_scale_input=moe.sigmoid_scales_input, b_gate_up=lp.b_experts_gate_up,
                      b_down=lp.b_experts_down, swiglu=moe.clamped_swiglu, gpu_kernel=gpu_kernel)
    if lp.w_shared_gate_up is not None:
        shared = gated_mlp(x, lp.w_shared_gate_up, lp.w_shared_down, activation, kernel=kernel).reshape(B * S, D)
        if lp.shared_gate is not None:
            shared = jax.nn.sigmoid(jnp.sum(h * lp.shared_gate, axis=-1, keepdims=True)) * shared
        out = out + shared
    return out.reshape(B, S, D).astype(x.dtype), _routed(routing, moe.num_experts, flat_valid)[1]
