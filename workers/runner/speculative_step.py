"""Speculative decoding's step: the draft model's and the target's programs, and their inputs.

The proposer (``workers/core/speculation.py``: a draft model, or n-gram lookup on the host)
guesses up to ``k`` tokens per row; ``spec_decode_program`` scores each row's last token and
its guesses in one target call and accepts the longest prefix of guesses equal to the
target's own samples (exact: see ``workers/core/speculation.py``). Rows with different numbers of
guesses share a batch (padding at position -1).

A draft model keeps its own KV pool under the target's block tables. It computes every
prompt chunk with the target, and in a speculative step the row's window (its known tokens
it has not computed) and then its guesses but the last. When the target accepts every guess,
the draft has not computed the last guess, which the target emitted as a known token: the
draft is one token behind (the sequence's ``draft_lag``, reported in ``RunnerOutput.draft_lags``
and applied by the scheduler), and the next step's window starts one token earlier
(``ScheduledDecode.window``). Stale draft K/V past a rejected guess is overwritten, not
rolled back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.forward import forward, full_table
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.decoder.params import ModelParams
from raylm.workers.core.speculation import SpeculativeConfig, propose_ngram
from raylm.workers.core.step_plan import ScheduledDecode, ScheduledRow
from raylm.workers.runner.grammar_masks import accepted_prefix
from raylm.workers.runner.sampler import advance, argmax, sample


@dataclasses.dataclass
class DraftModel:
    """A draft model inside the replica: its weights and its own KV pool, which uses the
    target's block tables (same block ids, same sizes), so prefix caching, preemption,
    forks and frees need no second bookkeeping."""

    config: ModelConfig
    params: ModelParams
    kv: KVCache


def assert_room_for_guesses(decode: ScheduledDecode, block_size: int) -> None:
    """The scheduler grew the row's blocks for its guesses (leaving out what max_tokens could
    not emit): a guess past them would write another sequence's block."""
    room = len(decode.row.block_ids) * block_size - decode.position - 1
    if decode.guesses > room:
        raise AssertionError(f"sequence {decode.row.seq_id} was allowed {decode.guesses} guesses "
                             f"but holds room for {room}")


def _forward_rows(params, config, kv, tokens, positions, block_tables, *, cpu_kernels, last_only, lora=None,
                  expert_load=None, gpu_kernels=False):
    """``tokens [B, S]`` at ``positions [B, S]`` (-1: padding, real tokens first in a row) of
    rows with ``block_tables [B, P]`` (``[2, B, P]``: per KV group, see ``model.decoder.forward``):
    logits of every token ``[B, S, V]``, or of each row's last real token ``[B, V]``. With the
    CPU kernels the tokens are packed one per row (each sees the keys up to its own position),
    else one row of S tokens each (the jnp path, or the Pallas kernels on a GPU with ``gpu_kernels``).
    ``lora``: a LoRA slot per row
    (``model.decoder.lora_slots.LoraBatch``), or None. Returns the logits, the pool and, with
    ``expert_load`` (``model.decoder.forward.forward``), that plus these tokens' routing (else None)."""
    B, S = tokens.shape
    if not cpu_kernels:
        context = jnp.max(positions, axis=1) + 1
        logits, kv, *load = forward(params, config, tokens, positions, kv, block_tables, context,
                                    all_logits=not last_only, lora=lora, expert_load=expert_load,
                                    gpu_kernels=gpu_kernels)
        return logits, kv, (load or [None])[0]
    flat = positions.reshape(B * S)
    last = None
    if last_only:
        last = jnp.arange(B) * S + jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    logits, kv, *load = forward(
        params, config, tokens.reshape(B * S, 1), flat[:, None], kv, jnp.repeat(block_tables, S, axis=-2),
        jnp.where(flat >= 0, flat + 1, 0), cpu_kernels=True, logits_rows=last,
        lora=None if lora is None else lora._replace(slots=jnp.repeat(lora.slots, S)), expert_load=expert_load,
    )
    return (logits if last_only else logits.reshape(B, S, -1)), kv, (load or [None])[0]


def _window_last(window_tokens: jax.Array, window_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's last known token and its position (-1 for a padding row)."""
    last = jnp.sum(window_positions >= 0, axis=1) - 1
    rows = jnp.arange(window_tokens.shape[0])
    last_tokens = window_tokens[rows, jnp.maximum(last, 0)]
    return last_tokens, jnp.where(last >= 0, window_positions[rows, jnp.maximum(last, 0)], -1)


def _draft_guesses(draft_params, draft_config, draft_kv, window_tokens, window_positions, num_drafts, block_tables,
                   num_speculative, cpu_kernels):
    """The draft model computes each row's window, then proposes ``num_speculative`` tokens by
    its argmax, writing positions only up to what the row may draft (``num_drafts [B]``).
    Returns the guesses ``[B, K]`` and the draft's pool. It reads the full-attention layers'
    table in every layer (``full_table``)."""
    block_tables = full_table(block_tables)
    _, last_positions = _window_last(window_tokens, window_positions)
    logits, draft_kv, _ = _forward_rows(draft_params, draft_config, draft_kv, window_tokens, window_positions,
                                        block_tables, cpu_kernels=cpu_kernels, last_only=True)
    # Unrolled (k is small): a scan carrying the pool made XLA copy the whole pool each step.
    guesses = [argmax(logits)]
    for j in range(1, num_speculative):
        position = jnp.where(j < num_drafts, last_positions + j, -1)
        logits, draft_kv, _ = _forward_rows(draft_params, draft_config, draft_kv, guesses[-1][:, None],
                                            position[:, None], block_tables, cpu_kernels=cpu_kernels, last_only=True)
        guesses.append(argmax(logits))
    return jnp.stack(guesses, axis=1), draft_kv


@functools.partial(
    jax.jit, static_argnames=("draft_config", "num_speculative", "cpu_kernels"), donate_argnames=("draft_kv",),
)
def draft_program(draft_params, draft_kv, window_tokens, window_positions, num_drafts, block_tables, *,
                   draft_config, num_speculative, cpu_kernels):
    """The draft model's guesses alone (``_draft_guesses``), for a step whose guesses the host
    checks before the target verifies them (structured output rows)."""
    return _draft_guesses(draft_params, draft_config, draft_kv, window_tokens, window_positions, num_drafts,
                          block_tables, num_speculative, cpu_kernels)


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_speculative", "num_logprobs", "with_penalties", "cpu_kernels",
                     "gpu_kernels"),
    donate_argnames=("kv", "draft_kv", "expert_load"),
)
def spec_decode_program(params, kv, draft_params, draft_kv, window_tokens, window_positions, proposals,
                         num_drafts, block_tables, sbatch, position_bitmasks=None, lora=None, expert_load=None, *,
                         config, draft_config, num_speculative, num_logprobs, with_penalties, cpu_kernels,
                         gpu_kernels=False):
    """One speculative decode step: propose, then verify every row's ``1 + num_drafts`` tokens.

    ``window_tokens/positions [B, 2]`` hold each row's known tokens the draft has not computed
    (its last token, after the one it is behind by when the previous step accepted every
    guess), padding at -1. A draft model (``draft_config``) proposes (``_draft_guesses``);
    otherwise ``proposals [B, K]`` come from the host (n-gram, or a draft's guesses the host
    checked). The target then scores the row's last token and its guesses in one call and
    samples at each position with the state plain decoding would have there (penalty counts
    and the random stream advanced past the guesses before it, and with
    ``position_bitmasks [K + 1, B, W]`` structured output's allowed tokens after them). A
    guess is accepted while it equals the target's own token, so rows emit ``accepted + 1``
    tokens. Returns the samples ``[K + 1, B]``, ``accepted [B]``, both pools and the
    ``expert_load`` (as in ``workers.runner.programs.prefill_program``: the target's scored tokens
    added; None without one). With ``lora`` (a slot per row) the target scores with each row's
    adapter. ``gpu_kernels``: the target's verification through the Pallas kernels on a GPU (as its
    plain decode steps, so both score alike).
    """
    K = num_speculative
    last_tokens, last_positions = _window_last(window_tokens, window_positions)
    if draft_config is not None:
        proposals, draft_kv = _draft_guesses(draft_params, draft_config, draft_kv, window_tokens, window_positions,
                                             num_drafts, block_tables, K, cpu_kernels)
    if K == 0:
        proposals = jnp.zeros((window_tokens.shape[0], 0), jnp.int32)
    drafts = jnp.where(jnp.arange(K)[None, :] < num_drafts[:, None], proposals, -1)

    offsets = jnp.arange(K + 1)
    verify_tokens = jnp.concatenate([last_tokens[:, None], jnp.maximum(drafts, 0)], axis=1)
    verify_positions = jnp.where(
        (offsets[None, :] <= num_drafts[:, None]) & (last_positions[:, None] >= 0),
        last_positions[:, None] + offsets[None, :], -1,
    )
    logits, kv, expert_load = _forward_rows(params, config, kv, verify_tokens, verify_positions, block_tables,
                                            cpu_kernels=cpu_kernels, last_only=False, lora=lora,
                                            expert_load=expert_load, gpu_kernels=gpu_kernels)
    results = []
    for j in range(K + 1):
        if position_bitmasks is not None:
            sbatch = dataclasses.replace(sbatch, token_bitmask=position_bitmasks[j])
        results.append(sample(logits[:, j], sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties))
        if j < K:
            sbatch = advance(sbatch, jnp.maximum(drafts[:, j], 0))
    samples = jax.tree.map(lambda *a: jnp.stack(a), *results)
    matches = drafts == samples.tokens[:K].T
    accepted = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)
    return samples, accepted, kv, draft_kv, expert_load


def window_inputs(decodes: list[ScheduledDecode], num_rows: int, uses_draft: bool) -> tuple[np.ndarray, np.ndarray]:
    """``window_tokens/positions [rows, 2]``: each row's known tokens the draft model has not
    computed (only the last token without a draft model), padding at position -1."""
    window_tokens = np.zeros((num_rows, 2), np.int32)
    window_positions = np.full((num_rows, 2), -1, np.int32)
    for r, decode in enumerate(decodes):
        window = decode.window if uses_draft else decode.window[-1:]
        window_tokens[r, : len(window)] = window
        window_positions[r, : len(window)] = np.arange(decode.position - len(window) + 1, decode.position + 1)
    return window_tokens, window_positions


def ngram_proposals(decodes: list[ScheduledDecode], spec: SpeculativeConfig) -> list[list[int]]:
    """Each row's n-gram guesses, at most the ``guesses`` it was scheduled for; a structured
    output row keeps only those its grammar accepts."""
    proposals = []
    for decode in decodes:
        row = decode.row
        guesses = propose_ngram([*row.prompt_ids, *row.output_ids], decode.guesses, spec.ngram_min,
                                spec.ngram_max) if decode.guesses else []
        proposals.append(guesses if row.matcher is None else guesses[: accepted_prefix(row.matcher, guesses)])
    return proposals


def check_draft_guesses(rows: list[ScheduledRow], guesses: np.ndarray, num_drafts: np.ndarray) -> None:
    """Cut each structured output row's draft guesses (``num_drafts``, in place) to those its
    grammar accepts, before the target verifies them."""
    for r, row in enumerate(rows):
        if row.matcher is not None:
            num_drafts[r] = accepted_prefix(row.matcher, guesses[r, : num_drafts[r]])
