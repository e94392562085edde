"""The compiled programs of a replica: prompt chunks, (multi-step) decode, block copies, and the
small helpers around them. Speculative decoding's programs are in ``workers/runner/speculative_step.py``.

Each program is one XLA program per (bucket, variant): static arguments pick the variant
(sampling flags, a draft model, hidden-state capture, returned logits), array shapes the
bucket (``workers/runner/batch_inputs.py``). Sampling runs inside the same program as the forward
pass, so only token ids (and requested logprobs) come back to the host. The pools (and the
hidden-state buffers, and an MoE model's expert-load counts) are donated: updated in place,
returned, and kept by the runner.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from raylm.model.decoder.attention import copy_blocks
from raylm.model.decoder.forward import HiddenSink, forward, full_table
from raylm.model.decoder.kv_pool import KVCache
from raylm.workers.runner.sampler import SampleResult, SamplingBatch, advance, sample


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_logprobs", "with_penalties", "num_pool_segments", "return_logits",
                     "gpu_kernels"),
    donate_argnames=("kv", "draft_kv", "hidden_buffers", "expert_load"),
)
def prefill_program(params, kv, draft_params, draft_kv, tokens, positions, block_tables, context_lens, sbatch,
                     pool_segments=None, hidden_buffers=None, hidden_where=None, lora=None, expert_load=None,
                     hidden_in=None, *,
                     config, draft_config, num_logprobs, with_penalties, num_pool_segments=0, return_logits=False,
                     gpu_kernels=False):
    """Prompt chunks a row each (``tokens [B, S]``), attention by the jnp path, or on a GPU by the
    Pallas kernel with ``gpu_kernels`` (the target model's; see ``packed_prefill_program`` for the
    CPU kernel's). A draft model (``draft_config``) computes the same chunks into its own pool, so
    it can propose from the prompt on. With ``pool_segments`` it also returns the chunks' pooled
    hidden states (embeddings); with ``hidden_buffers`` (donated) and ``hidden_where`` (each
    token's slot and index, see ``model.decoder.forward.HiddenSink``) it writes their hidden
    states there and returns the buffers last (else None). With ``return_logits`` the sampled logits come last too (logits
    processors run on them on the host; ``workers/core/logits_processors.py``). With ``lora`` (a
    ``model.decoder.lora_slots.LoraBatch``, a slot per row) the target model runs each row's adapter;
    a draft model never does. With ``expert_load`` (donated; an MoE model's tokens routed per
    expert, ``model.decoder.forward.forward``) the chunks' tokens are added to it and it comes last.
    A pipeline's last stage takes the previous stage's residual stream ``hidden_in`` (``[B, S, D]``,
    as ``forward``) in place of the tokens' embeddings."""
    hidden = _sink(hidden_buffers, hidden_where)
    logits, kv, pooled, hidden, expert_load = _forward_extras(forward(
        params, config, tokens, positions, kv, block_tables, context_lens, pool_segments=pool_segments,
        num_pool_segments=num_pool_segments, hidden_sink=hidden, lora=lora, expert_load=expert_load,
        hidden_in=hidden_in, gpu_kernels=gpu_kernels), pool_segments, hidden, expert_load)
    if draft_config is not None:
        _, draft_kv = forward(draft_params, draft_config, tokens, positions, draft_kv, full_table(block_tables),
                              context_lens)
    return (sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv, draft_kv, pooled,
            hidden, logits if return_logits else None, expert_load)


def _sink(buffers: jax.Array | None, where: tuple | None) -> HiddenSink | None:
    return None if buffers is None else HiddenSink(buffers, *where)


def _forward_extras(out: tuple, pool_segments, hidden, expert_load) -> tuple:
    """``forward``'s result as (logits, kv, pooled, hidden buffers, expert load), None for each
    extra not asked for."""
    logits, kv, *extras = out
    pooled = extras.pop(0) if pool_segments is not None else None
    buffers = extras.pop(0) if hidden is not None else None
    return logits, kv, pooled, buffers, extras.pop(0) if expert_load is not None else None


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_logprobs", "with_penalties", "num_pool_segments", "return_logits"),
    donate_argnames=("kv", "draft_kv", "hidden_buffers", "expert_load"),
)
def packed_prefill_program(params, kv, draft_params, draft_kv, tokens, positions, token_rows, block_tables,
                            last_tokens, sbatch, pool_segments=None, hidden_buffers=None, hidden_where=None,
                            lora=None, expert_load=None, hidden_in=None, *,
                            config, draft_config, num_logprobs, with_penalties, num_pool_segments=0,
                            return_logits=False):
    """Prompt chunks packed one token per row (``tokens [T]``, padding at position -1), attention
    by the paged kernel; ``token_rows [T]`` picks each token's chunk in ``block_tables [R, P]``
    and ``last_tokens [R]`` each chunk's last token, whose logits are sampled. A draft model
    computes the same tokens into its own pool. ``hidden_*``, ``return_logits``, ``lora`` and
    ``expert_load`` as in ``prefill_program``, one slot and index per token (``[T, 1]``), one
    LoRA slot per token; ``hidden_in`` (``[T, 1, D]``) as in ``prefill_program``."""
    hidden = _sink(hidden_buffers, hidden_where)
    context_lens = jnp.where(positions >= 0, positions + 1, 0)
    tables = block_tables[..., token_rows, :]  # ([G,] T, P): per KV group
    logits, kv, pooled, hidden, expert_load = _forward_extras(forward(
        params, config, tokens[:, None], positions[:, None], kv, tables, context_lens, cpu_kernels=True,
        logits_rows=last_tokens, pool_segments=None if pool_segments is None else pool_segments[:, None],
        num_pool_segments=num_pool_segments, hidden_sink=hidden, lora=lora, expert_load=expert_load,
        hidden_in=hidden_in), pool_segments, hidden, expert_load)
    if draft_config is not None:
        _, draft_kv = forward(draft_params, draft_config, tokens[:, None], positions[:, None], draft_kv,
                              full_table(tables), context_lens, cpu_kernels=True, logits_rows=last_tokens[:1])
    return (sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv, draft_kv, pooled,
            hidden, logits if return_logits else None, expert_load)


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_steps", "num_logprobs", "with_penalties", "cpu_kernels", "gpu_kernels",
                     "return_logits"),
    donate_argnames=("kv", "hidden_buffers", "expert_load"),
)
def decode_program(params, kv, tokens, positions, block_tables, limits, sbatch, hidden_buffers=None,
                    hidden_where=None, lora=None, expert_load=None, hidden_in=None, *, config, num_steps, num_logprobs,
                    with_penalties, cpu_kernels, gpu_kernels=False, return_logits=False):
    """``num_steps`` decode steps with sampling in one call; rows stop writing at ``limits``.
    With ``hidden_*`` as in ``prefill_program`` (``[B, 1]``: each row's slot and its index
    at the first step) every step writes its rows' hidden states there, without leaving the
    device; the buffers are returned next (else None), then with ``return_logits`` every
    step's logits ``[num_steps, B, V]`` (else None), then the ``expert_load`` (as in
    ``prefill_program``, every step's tokens added). ``lora`` as in ``prefill_program``; a
    pipeline's last stage takes ``hidden_in`` (``[B, 1, D]``) and decodes one step. ``gpu_kernels``:
    attention by the Pallas kernel on a GPU (``forward``)."""
    assert hidden_in is None or num_steps == 1, "a pipeline's stages decode one step at a time"
    hidden = _sink(hidden_buffers, hidden_where)

    def step(carry, _):
        kv, tokens, positions, sbatch, hidden, expert_load = carry
        context_lens = jnp.where(positions < limits, positions + 1, 0)
        logits, kv, _, buffers, expert_load = _forward_extras(forward(
            params, config, tokens[:, None], positions[:, None], kv, block_tables, context_lens,
            cpu_kernels=cpu_kernels, hidden_sink=hidden, lora=lora, expert_load=expert_load, hidden_in=hidden_in,
            gpu_kernels=gpu_kernels),
            None, hidden, expert_load)
        if hidden is not None:
            hidden = hidden._replace(buffers=buffers, index=hidden.index + 1)
        result = sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties)
        carry = (kv, result.tokens, positions + 1, advance(sbatch, result.tokens), hidden, expert_load)
        return carry, (result, logits if return_logits else None)

    (kv, *_, hidden, expert_load), (results, logits) = jax.lax.scan(
        step, (kv, tokens, positions, sbatch, hidden, expert_load), None, length=num_steps)
    return results, kv, None if hidden is None else hidden.buffers, logits, expert_load


@functools.partial(jax.jit, static_argnames=("config", "cpu_kernels"), donate_argnames=("kv", "expert_load"))
def stage_program(params, kv, tokens, positions, block_tables, context_lens, hidden_in=None, lora=None,
                  expert_load=None, *, config, cpu_kernels):
    """A pipeline stage before the last: its layers over ``tokens [B, S]`` (the first stage) or
    the previous stage's ``hidden_in [B, S, D]``, in whichever layout the last stage's program
    takes (packed prompt tokens ``[T, 1]``, prompt rows, decode rows ``[B, 1]``). Returns its
    residual stream ``[B, S, D]`` for the next stage, the pool, and ``expert_load`` (as in
    ``prefill_program``) or None."""
    x, kv, *load = forward(params, config, tokens, positions, kv, block_tables, context_lens,
                           cpu_kernels=cpu_kernels, lora=lora, expert_load=expert_load, hidden_in=hidden_in,
                           hidden_out=True)
    return x, kv, (load or [None])[0]


@functools.partial(jax.jit, static_argnames=("num_logprobs", "with_penalties"))
def resample(logits: jax.Array, sbatch: SamplingBatch, *, num_logprobs: int, with_penalties: bool) -> SampleResult:
    """``sample`` again, on logits the host's logits processors rewrote."""
    return sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties)


@jax.jit
def read_hidden(buffers: jax.Array, slot: jax.Array, layers: jax.Array) -> jax.Array:
    """``buffers[slot, layers]``: one program per number of layers, whichever slot."""
    return buffers[slot][layers]


@functools.partial(jax.jit, static_argnames=("cpu_kernels",), donate_argnames=("pools",))
def copy_blocks_program(pools: tuple[KVCache, ...], src: jax.Array, dst: jax.Array, *,
                        cpu_kernels: bool) -> tuple[KVCache, ...]:
    """Copy blocks ``src`` to ``dst`` in every layer of each pool (a model's, and its draft
    model's: one program; ``model.decoder.attention.copy_blocks``)."""
    return tuple(KVCache(copy_blocks(kv.k, src, dst, cpu_kernels), copy_blocks(kv.v, src, dst, cpu_kernels))
                 for kv in pools)
