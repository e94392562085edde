"""Runs scheduled work on the device: jitted prefill and (multi-step) decode over shape buckets.

Shapes are static inside jit, so batch sizes, chunk lengths and block-table widths are
rounded up to powers of two (buckets). Each (kind, bucket, sampling variant) is one XLA
program; ``warmup`` compiles them ahead of traffic and the persistent compilation cache
keeps them across restarts. Sampling runs inside the same program as the forward pass, so
only token ids (and requested logprobs) come back to the host.

A step's programs (prefill groups, then the decode) are all dispatched before any result is
fetched: JAX runs them back to back on the device while the host waits once, so running
sequences never wait for a host round trip behind a prefill. Attention (prompt chunks and
decode tokens alike) goes through the CPU paged kernel where it can run
(``model.paged_decode``); its cost follows each query's real context, so programs then use
one block-table width instead of a bucket per width, and a step's prompt chunks are packed
back to back, one token per row (the kernel gives each token its own context), into one
call per token bucket instead of one per (rows, chunk length, width) bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model import KVCache, ModelConfig, ModelParams, paged_decode, shard_params
from model.attention import copy_blocks
from model.forward import HiddenSink, PooledHidden, forward
from model.buckets import bucket, cdiv, power_buckets
from workers.hidden_states import HiddenStateCapture
from workers.logits_processors import LogitsProcessorError, apply_processors
from workers.sampler import (
    SampleResult,
    SamplingBatch,
    advance,
    argmax,
    build_sampling_batch,
    logprobs_bucket,
    sample,
)
from workers.scheduler import ScheduledChunk
from workers.sequence import Sequence
from workers.speculative import SpecDecodeStats, SpeculativeConfig, propose_ngram
from workers.structured_output import accepted_prefix, allow_all, fill_bitmasks_along

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
MIN_WIDTH_BUCKET = 8


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_logprobs", "with_penalties", "num_pool_segments", "return_logits"),
    donate_argnames=("kv", "draft_kv", "hidden_buffers"),
)
def _prefill_program(params, kv, draft_params, draft_kv, tokens, positions, block_tables, context_lens, sbatch,
                     pool_segments=None, hidden_buffers=None, hidden_where=None, *, config, draft_config,
                     num_logprobs, with_penalties, num_pool_segments=0, return_logits=False):
    """Prompt chunks a row each (``tokens [B, S]``), attention by the jnp path (see
    ``_packed_prefill_program`` for the kernel's). A draft model (``draft_config``) computes
    the same chunks into its own pool, so it can propose from the prompt on. With
    ``pool_segments`` it also returns the chunks' pooled hidden states (embeddings); with
    ``hidden_buffers`` (donated) and ``hidden_where`` (each token's slot and index, see
    ``model.forward.HiddenSink``) it writes their hidden states there and returns the buffers
    last (else None). With ``return_logits`` the sampled logits come last too (logits
    processors run on them on the host; ``workers/logits_processors.py``)."""
    hidden = _sink(hidden_buffers, hidden_where)
    logits, kv, pooled, hidden = _forward_extras(forward(
        params, config, tokens, positions, kv, block_tables, context_lens, pool_segments=pool_segments,
        num_pool_segments=num_pool_segments, hidden_sink=hidden), pool_segments, hidden)
    if draft_config is not None:
        _, draft_kv = forward(draft_params, draft_config, tokens, positions, draft_kv, block_tables, context_lens)
    return (sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv, draft_kv, pooled,
            hidden, logits if return_logits else None)


def _sink(buffers: jax.Array | None, where: tuple | None) -> HiddenSink | None:
    return None if buffers is None else HiddenSink(buffers, *where)


def _forward_extras(out: tuple, pool_segments, hidden) -> tuple:
    """``forward``'s result as (logits, kv, pooled or None, hidden buffers or None)."""
    logits, kv, *extras = out
    pooled = extras.pop(0) if pool_segments is not None else None
    return logits, kv, pooled, extras.pop(0) if hidden is not None else None


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_logprobs", "with_penalties", "num_pool_segments", "return_logits"),
    donate_argnames=("kv", "draft_kv", "hidden_buffers"),
)
def _packed_prefill_program(params, kv, draft_params, draft_kv, tokens, positions, token_rows, block_tables,
                            last_tokens, sbatch, pool_segments=None, hidden_buffers=None, hidden_where=None, *,
                            config, draft_config, num_logprobs, with_penalties, num_pool_segments=0,
                            return_logits=False):
    """Prompt chunks packed one token per row (``tokens [T]``, padding at position -1), attention
    by the paged kernel; ``token_rows [T]`` picks each token's chunk in ``block_tables [R, P]``
    and ``last_tokens [R]`` each chunk's last token, whose logits are sampled. A draft model
    computes the same tokens into its own pool. ``hidden_*`` and ``return_logits`` as in
    ``_prefill_program``, one slot and index per token (``[T, 1]``)."""
    hidden = _sink(hidden_buffers, hidden_where)
    context_lens = jnp.where(positions >= 0, positions + 1, 0)
    tables = block_tables[token_rows]
    logits, kv, pooled, hidden = _forward_extras(forward(
        params, config, tokens[:, None], positions[:, None], kv, tables, context_lens, cpu_kernels=True,
        logits_rows=last_tokens, pool_segments=None if pool_segments is None else pool_segments[:, None],
        num_pool_segments=num_pool_segments, hidden_sink=hidden), pool_segments, hidden)
    if draft_config is not None:
        _, draft_kv = forward(draft_params, draft_config, tokens[:, None], positions[:, None], draft_kv, tables,
                              context_lens, cpu_kernels=True, logits_rows=last_tokens[:1])
    return (sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv, draft_kv, pooled,
            hidden, logits if return_logits else None)


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_steps", "num_logprobs", "with_penalties", "cpu_kernels", "return_logits"),
    donate_argnames=("kv", "hidden_buffers"),
)
def _decode_program(params, kv, tokens, positions, block_tables, limits, sbatch, hidden_buffers=None,
                    hidden_where=None, *, config, num_steps, num_logprobs, with_penalties, cpu_kernels,
                    return_logits=False):
    """``num_steps`` decode steps with sampling in one call; rows stop writing at ``limits``.
    With ``hidden_*`` as in ``_prefill_program`` (``[B, 1]``: each row's slot and its index
    at the first step) every step writes its rows' hidden states there, without leaving the
    device; the buffers are returned next (else None), then with ``return_logits`` every
    step's logits ``[num_steps, B, V]`` (else None)."""
    hidden = _sink(hidden_buffers, hidden_where)

    def step(carry, _):
        kv, tokens, positions, sbatch, hidden = carry
        context_lens = jnp.where(positions < limits, positions + 1, 0)
        logits, kv, _, buffers = _forward_extras(forward(
            params, config, tokens[:, None], positions[:, None], kv, block_tables, context_lens,
            cpu_kernels=cpu_kernels, hidden_sink=hidden), None, hidden)
        if hidden is not None:
            hidden = hidden._replace(buffers=buffers, index=hidden.index + 1)
        result = sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties)
        carry = (kv, result.tokens, positions + 1, advance(sbatch, result.tokens), hidden)
        return carry, (result, logits if return_logits else None)

    (kv, *_, hidden), (results, logits) = jax.lax.scan(
        step, (kv, tokens, positions, sbatch, hidden), None, length=num_steps)
    return results, kv, None if hidden is None else hidden.buffers, logits


def _forward_rows(params, config, kv, tokens, positions, block_tables, *, cpu_kernels, last_only):
    """``tokens [B, S]`` at ``positions [B, S]`` (-1: padding, real tokens first in a row) of
    rows with ``block_tables [B, P]``: logits of every token ``[B, S, V]``, or of each row's
    last real token ``[B, V]``. With the CPU kernels the tokens are packed one per row (each
    sees the keys up to its own position), else one row of S tokens each (the jnp path)."""
    B, S = tokens.shape
    if not cpu_kernels:
        context = jnp.max(positions, axis=1) + 1
        logits, kv = forward(params, config, tokens, positions, kv, block_tables, context, all_logits=not last_only)
        return logits, kv
    flat = positions.reshape(B * S)
    last = None
    if last_only:
        last = jnp.arange(B) * S + jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    logits, kv = forward(
        params, config, tokens.reshape(B * S, 1), flat[:, None], kv, jnp.repeat(block_tables, S, axis=0),
        jnp.where(flat >= 0, flat + 1, 0), cpu_kernels=True, logits_rows=last,
    )
    return (logits if last_only else logits.reshape(B, S, -1)), kv


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
    Returns the guesses ``[B, K]`` and the draft's pool."""
    _, last_positions = _window_last(window_tokens, window_positions)
    logits, draft_kv = _forward_rows(draft_params, draft_config, draft_kv, window_tokens, window_positions,
                                     block_tables, cpu_kernels=cpu_kernels, last_only=True)
    # Unrolled (k is small): a scan carrying the pool made XLA copy the whole pool each step.
    guesses = [argmax(logits)]
    for j in range(1, num_speculative):
        position = jnp.where(j < num_drafts, last_positions + j, -1)
        logits, draft_kv = _forward_rows(draft_params, draft_config, draft_kv, guesses[-1][:, None],
                                         position[:, None], block_tables, cpu_kernels=cpu_kernels, last_only=True)
        guesses.append(argmax(logits))
    return jnp.stack(guesses, axis=1), draft_kv


@functools.partial(
    jax.jit, static_argnames=("draft_config", "num_speculative", "cpu_kernels"), donate_argnames=("draft_kv",),
)
def _draft_program(draft_params, draft_kv, window_tokens, window_positions, num_drafts, block_tables, *,
                   draft_config, num_speculative, cpu_kernels):
    """The draft model's guesses alone (``_draft_guesses``), for a step whose guesses the host
    checks before the target verifies them (structured output rows)."""
    return _draft_guesses(draft_params, draft_config, draft_kv, window_tokens, window_positions, num_drafts,
                          block_tables, num_speculative, cpu_kernels)


@functools.partial(
    jax.jit,
    static_argnames=("config", "draft_config", "num_speculative", "num_logprobs", "with_penalties", "cpu_kernels"),
    donate_argnames=("kv", "draft_kv"),
)
def _spec_decode_program(params, kv, draft_params, draft_kv, window_tokens, window_positions, proposals,
                         num_drafts, block_tables, sbatch, position_bitmasks=None, *, config, draft_config,
                         num_speculative, num_logprobs, with_penalties, cpu_kernels):
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
    tokens. Returns the samples ``[K + 1, B]``, ``accepted [B]``, and both pools.
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
    logits, kv = _forward_rows(params, config, kv, verify_tokens, verify_positions, block_tables,
                               cpu_kernels=cpu_kernels, last_only=False)
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
    return samples, accepted, kv, draft_kv


def _pooling_args(chunks: list[ScheduledChunk], rows: int, token_rows: np.ndarray) -> dict:
    """A prefill program's arguments to pool embedding chunks' hidden states, none when no chunk
    is an embedding's: each token's segment is its chunk's row (``token_rows``), -1 for tokens
    of other chunks (padding tokens the program leaves out itself)."""
    embeds = [r for r, c in enumerate(chunks) if c.seq.embedding is not None]
    if not embeds:
        return {}
    pooled = np.zeros(rows, bool)
    pooled[embeds] = True
    return dict(pool_segments=np.where(pooled[token_rows], token_rows, -1).astype(np.int32), num_pool_segments=rows)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "with_penalties"))
def _resample(logits: jax.Array, sbatch: SamplingBatch, *, num_logprobs: int, with_penalties: bool) -> SampleResult:
    """``sample`` again, on logits the host's logits processors rewrote."""
    return sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties)


def _logits_flag(seqs: list[Sequence]) -> dict:
    """A program returns its logits only when a row has logits processors (another variant)."""
    return {"return_logits": True} if any(s.params.logits_processors for s in seqs) else {}


@jax.jit
def _read_hidden(buffers: jax.Array, slot: jax.Array, layers: jax.Array) -> jax.Array:
    """``buffers[slot, layers]``: one program per number of layers, whichever slot."""
    return buffers[slot][layers]


@functools.partial(jax.jit, static_argnames=("cpu_kernels",), donate_argnames=("kv",))
def _copy_blocks(kv: KVCache, src: jax.Array, dst: jax.Array, *, cpu_kernels: bool) -> KVCache:
    """Copy blocks ``src`` to ``dst`` in every layer (``model.attention.copy_blocks``)."""
    return KVCache(copy_blocks(kv.k, src, dst, cpu_kernels), copy_blocks(kv.v, src, dst, cpu_kernels))


@dataclasses.dataclass
class DraftModel:
    """A draft model inside the replica: its weights and its own KV pool, which uses the
    target's block tables (same block ids, same sizes), so prefix caching, preemption,
    forks and frees need no second bookkeeping."""

    config: ModelConfig
    params: ModelParams
    kv: KVCache


class ModelRunner:
    """Owns the weights and the device KV pool of one replica and executes scheduler output."""

    def __init__(
        self,
        config: ModelConfig,
        params: ModelParams,
        kv: KVCache,
        mesh: Mesh,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_ids: frozenset[int],
        speculative: SpeculativeConfig | None = None,
        draft: DraftModel | None = None,
        hidden_state_buffers: tuple[int, int] = (0, 0),
    ):
        self.config = config
        self.mesh = mesh
        self.params = shard_params(params, config, mesh)
        self.kv = kv
        self.block_size = kv.block_size
        self.eos_ids = eos_ids
        self.max_batch = bucket(max_num_seqs, 1, 1 << 30)
        self.max_tokens_bucket = bucket(max_num_batched_tokens, MIN_TOKEN_BUCKET, 1 << 30)
        self.max_width = bucket(cdiv(max_model_len, self.block_size), MIN_WIDTH_BUCKET, 1 << 30)
        self.cpu_kernels = _cpu_kernels_run(mesh, kv)
        self.speculative = speculative
        if draft is not None:
            draft = dataclasses.replace(draft, params=shard_params(draft.params, draft.config, mesh))
        self.draft = draft
        self.spec_stats = SpecDecodeStats()
        # Requests whose logits processor failed this step (seq_id -> error): the engine aborts them.
        self.processor_failures: dict[int, str] = {}
        # Hidden-state extraction (workers/hidden_states.py): [slots, L + 1, max_tokens, D].
        slots, max_tokens = hidden_state_buffers
        self.hidden_buffers = jnp.zeros((slots, config.num_layers + 1, max_tokens, config.hidden_size), jnp.float32) \
            if slots else None

    def _hidden_sink(self, seqs: list[Sequence | None], positions: np.ndarray) -> dict:
        """The ``hidden_buffers`` / ``hidden_where`` arguments of a program whose token
        ``[b, s]`` belongs to ``seqs[b]`` at ``positions[b, s]``; none (the program without
        them) when no sequence captures."""
        if not any(s is not None and s.hidden is not None for s in seqs):
            return {}
        num_slots = self.hidden_buffers.shape[0]
        slots = np.full(positions.shape, num_slots, np.int32)
        index = np.zeros(positions.shape, np.int32)
        for b, seq in enumerate(seqs):
            if seq is not None and seq.hidden is not None:
                slots[b] = seq.hidden.slot
                index[b] = positions[b] - seq.hidden.start
        return {"hidden_buffers": self.hidden_buffers, "hidden_where": (slots, index)}

    def read_hidden_states(self, capture: HiddenStateCapture, num_tokens: int) -> np.ndarray:
        """A finished capture's requested layers, ``[layers, positions, D]`` (one transfer)."""
        count = capture.count(num_tokens)
        layers = _read_hidden(self.hidden_buffers, np.int32(capture.slot), np.asarray(capture.layers, np.int32))
        return np.asarray(jax.device_get(layers))[:, :count].copy()

    @property
    def _draft_args(self) -> tuple:
        """(params, kv) of the draft model, (None, None) without one."""
        return (self.draft.params, self.draft.kv) if self.draft else (None, None)

    @property
    def _draft_config(self) -> ModelConfig | None:
        return self.draft.config if self.draft else None

    def _keep_hidden(self, buffers: jax.Array | None) -> None:
        """A program's updated hidden-state buffers (it was given them donated)."""
        if buffers is not None:
            self.hidden_buffers = buffers

    def _set_draft_kv(self, kv: KVCache | None) -> None:
        if self.draft is not None:
            self.draft.kv = kv

    def _widths(self) -> list[int]:
        """Block-table widths a program may use: the kernel's cost does not depend on the width,
        so it gets one (fewer programs to compile); the jnp path pays for the width, so buckets."""
        if self.cpu_kernels:
            return [self.max_width]
        return power_buckets(MIN_WIDTH_BUCKET, self.max_width)

    def _width(self, seqs: list[Sequence]) -> int:
        needed = min(max(len(s.block_ids) for s in seqs), self.max_width)
        return next(w for w in self._widths() if w >= needed)

    # -- host-side batch assembly -------------------------------------------------------------------
    def _block_table(self, seqs: list[Sequence], rows: int, width: int) -> np.ndarray:
        table = np.zeros((rows, width), np.int32)
        for r, seq in enumerate(seqs):
            table[r, : len(seq.block_ids)] = seq.block_ids
        return table

    def _sampling(self, seqs: list[Sequence], rows: int,
                  token_bitmask: np.ndarray | None = None) -> tuple[SamplingBatch, dict]:
        """The rows' sampling batch and program flags; the structured output bitmask is the
        next token's (``_token_bitmask``) unless one is given."""
        params = [s.params for s in seqs]
        with_penalties = any(p.uses_penalties for p in params)
        if token_bitmask is None:
            token_bitmask = self._token_bitmask(seqs, rows)
        sbatch = build_sampling_batch(
            [(s.params, s.seed, len(s.output_ids), s.prompt_ids, s.output_ids) for s in seqs],
            rows, self.config.vocab_size, self.eos_ids, with_penalties, token_bitmask,
        )
        flags = dict(num_logprobs=logprobs_bucket(params), with_penalties=with_penalties)
        return sbatch, flags

    def _token_bitmask(self, seqs: list[Sequence], rows: int) -> np.ndarray | None:
        """Structured output's allowed next tokens per row (all allowed for free rows), or None
        when no row is constrained. Valid for the next sampled token only."""
        if not any(s.matcher is not None for s in seqs):
            return None
        no_guesses = np.zeros((rows, 0), np.int32)
        return self._position_bitmasks(seqs, rows, no_guesses, np.zeros(rows, np.int32))[0]

    def _position_bitmasks(self, seqs: list[Sequence], rows: int, guesses: np.ndarray,
                           num_drafts: np.ndarray) -> np.ndarray:
        """``[K + 1, rows, W]``: at verify position ``j``, the tokens each constrained row's
        grammar allows after its first ``j`` guesses (all tokens for free rows and past a
        row's guesses, where nothing is accepted)."""
        K = guesses.shape[1]
        masks = np.stack([allow_all(rows, self.config.vocab_size)] * (K + 1))
        for r, seq in enumerate(seqs):
            if seq.matcher is not None:
                fill_bitmasks_along(seq.matcher, guesses[r, : num_drafts[r]], masks, r)
        return masks

    # -- execution ------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = zip(*copies)
            n = bucket(len(copies), 1, max(self.max_batch, len(copies)))
            # Pad with null-block self copies so the program count stays logarithmic.
            src_arr = np.zeros(n, np.int32)
            dst_arr = np.zeros(n, np.int32)
            src_arr[: len(src)], dst_arr[: len(dst)] = src, dst
            self.kv = _copy_blocks(self.kv, src_arr, dst_arr, cpu_kernels=self.cpu_kernels)
            if self.draft is not None:
                self.draft.kv = _copy_blocks(self.draft.kv, src_arr, dst_arr, cpu_kernels=self.cpu_kernels)

    def execute(
        self, chunks: list[ScheduledChunk], seqs: list[Sequence], num_steps: int,
        guesses: Mapping[int, int] | None = None,
    ) -> dict[int, list[SampleResult]]:
        """Run one engine step: prompt chunks and ``num_steps`` decode tokens for ``seqs``, or,
        with speculative decoding, each sequence's last token and up to ``guesses[seq_id]``
        guesses verified in one step.

        Every program is dispatched before the first result is fetched (one host wait per
        step). Returns, per sequence id, the samples of its decode steps (in order; a
        speculative step's accepted guesses and the target's token after them) and, for a
        chunk that reaches its sequence's last known token, that chunk's sample.
        """
        if self.cpu_kernels:
            pending = [self._dispatch_packed_prefill(group, n) for group, n in self._packed_groups(chunks)]
        else:
            pending = [self._dispatch_prefill(group, length) for group, length in self._prefill_groups(chunks)]
        if seqs:
            assert num_steps == 1 or not any(s.host_before_each_token for s in seqs), "one step at a time"
            pending.append(self._dispatch_decode_step(seqs, num_steps, guesses or {}))
        out: dict[int, list[SampleResult]] = {}
        for collect in pending:
            out.update(collect())
        return out

    def _prefill_groups(self, chunks: list[ScheduledChunk]) -> list[tuple[list[ScheduledChunk], int]]:
        """Chunks a row each, grouped by chunk-length bucket (bounded padding), at most the token
        budget per call."""
        groups: dict[int, list[ScheduledChunk]] = {}
        for chunk in chunks:
            groups.setdefault(bucket(chunk.num_tokens, MIN_TOKEN_BUCKET, self.max_tokens_bucket), []).append(chunk)
        out = []
        for length, group in sorted(groups.items()):
            rows_cap = max(1, self.max_tokens_bucket // length)
            out += [(group[i : i + rows_cap], length) for i in range(0, len(group), rows_cap)]
        return out

    def _packed_rows(self, num_tokens: int) -> int:
        """Chunks a packed prefill of ``num_tokens`` (a bucket) holds: one per 16 tokens, so the
        program count is one per token bucket and sampling pads at most 1/16 of the tokens."""
        return min(self.max_batch, max(1, num_tokens // MIN_TOKEN_BUCKET))

    def _packed_groups(self, chunks: list[ScheduledChunk]) -> list[tuple[list[ScheduledChunk], int]]:
        """Chunks packed back to back into as few calls as the token budget and the chunks per
        call allow, each with the smallest token bucket that holds it."""
        groups: list[list[ScheduledChunk]] = []
        tokens = 0
        for chunk in chunks:
            assert chunk.num_tokens <= self.max_tokens_bucket, (chunk.num_tokens, self.max_tokens_bucket)
            full = tokens + chunk.num_tokens > self.max_tokens_bucket
            if not groups or full or len(groups[-1]) == self._packed_rows(self.max_tokens_bucket):
                groups.append([])
                tokens = 0
            groups[-1].append(chunk)
            tokens += chunk.num_tokens
        return [(group, self._packed_bucket(group)) for group in groups]

    def _packed_bucket(self, group: list[ScheduledChunk]) -> int:
        need = sum(c.num_tokens for c in group)
        return next(n for n in power_buckets(MIN_TOKEN_BUCKET, self.max_tokens_bucket)
                    if n >= need and self._packed_rows(n) >= len(group))

    def _dispatch_packed_prefill(
        self, chunks: list[ScheduledChunk], num_tokens: int
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        rows = self._packed_rows(num_tokens)
        seqs = [c.seq for c in chunks]
        tokens = np.zeros(num_tokens, np.int32)
        positions = np.full(num_tokens, -1, np.int32)
        token_rows = np.zeros(num_tokens, np.int32)
        last_tokens = np.zeros(rows, np.int32)
        at = 0
        for r, chunk in enumerate(chunks):
            start, n = chunk.start, chunk.num_tokens
            tokens[at : at + n] = chunk.seq.all_ids[start : start + n]
            positions[at : at + n] = np.arange(start, start + n)
            token_rows[at : at + n] = r
            last_tokens[r] = at + n - 1
            at += n
        sbatch, flags = self._sampling(seqs, rows)
        pooling = _pooling_args(chunks, rows, token_rows)
        token_seqs = [seqs[r] if p >= 0 else None for r, p in zip(token_rows, positions)]
        sink = self._hidden_sink(token_seqs, positions[:, None])
        result, self.kv, draft_kv, pooled, hidden, logits = _packed_prefill_program(
            self.params, self.kv, *self._draft_args, tokens, positions, token_rows,
            self._block_table(seqs, rows, self.max_width), last_tokens, sbatch, config=self.config,
            draft_config=self._draft_config, **flags, **pooling, **sink, **_logits_flag(seqs),
        )
        self._set_draft_kv(draft_kv)
        self._keep_hidden(hidden)
        return self._collect_chunks(chunks, result, pooled, self._processing(
            seqs, logits, sbatch, flags, [c.samples for c in chunks]))

    def _dispatch_prefill(
        self, chunks: list[ScheduledChunk], length: int
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        rows = bucket(len(chunks), 1, self.max_batch)
        seqs = [c.seq for c in chunks]
        width = self._width(seqs)
        tokens = np.zeros((rows, length), np.int32)
        positions = np.zeros((rows, length), np.int32)
        context = np.zeros(rows, np.int32)
        for r, chunk in enumerate(chunks):
            start, n = chunk.start, chunk.num_tokens
            tokens[r, :n] = chunk.seq.all_ids[start : start + n]
            positions[r] = np.arange(start, start + length)
            context[r] = start + n
        sbatch, flags = self._sampling(seqs, rows)
        pooling = _pooling_args(chunks, rows, np.arange(rows)[:, None].repeat(length, 1))
        sink = self._hidden_sink(seqs + [None] * (rows - len(seqs)), positions)
        result, self.kv, draft_kv, pooled, hidden, logits = _prefill_program(
            self.params, self.kv, *self._draft_args, tokens, positions, self._block_table(seqs, rows, width),
            context, sbatch, config=self.config, draft_config=self._draft_config, **flags, **pooling, **sink,
            **_logits_flag(seqs),
        )
        self._set_draft_kv(draft_kv)
        self._keep_hidden(hidden)
        return self._collect_chunks(chunks, result, pooled, self._processing(
            seqs, logits, sbatch, flags, [c.samples for c in chunks]))

    def _processing(self, seqs: list[Sequence], logits: jax.Array | None, sbatch: SamplingBatch, flags: dict,
                    samples: list[bool] | None = None) -> Callable[[SampleResult, int], SampleResult] | None:
        """For a call whose rows ``seqs`` include logits processors: a function taking the
        fetched samples of one step (``[B]`` rows) and returning them with those rows sampled
        again from their processed logits (``workers/logits_processors.py``). A row whose
        processor fails keeps no sample and its request is recorded in ``processor_failures``.
        ``samples``: which rows sample (a prompt chunk that does not end its prompt does not)."""
        if logits is None:
            return None

        def process(fetched: SampleResult, step: int | None = None) -> SampleResult:
            host = np.array(jax.device_get(logits if step is None else logits[step]))
            rows = []
            for r, seq in enumerate(seqs):
                if seq.params.logits_processors and (samples is None or samples[r]):
                    try:
                        host[r] = apply_processors(seq.params.logits_processors, seq.prompt_ids, seq.output_ids,
                                                   host[r])
                        rows.append(r)
                    except LogitsProcessorError as err:
                        logger.error("request %s: %s", seq.request_id, err)
                        self.processor_failures[seq.seq_id] = str(err)
            again = jax.device_get(_resample(jnp.asarray(host), sbatch, **flags))
            picked = np.zeros(len(host), bool)
            picked[rows] = True
            return SampleResult(*(np.where(picked.reshape(-1, *[1] * (np.ndim(a) - 1)), b, a)
                                  for a, b in zip(fetched, again)))

        return process

    def _collect_chunks(
        self, chunks: list[ScheduledChunk], result: SampleResult, pooled: PooledHidden | None,
        process: Callable[[SampleResult], SampleResult] | None = None,
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        """Fetches a prefill call's samples: row ``r`` belongs to ``chunks[r]``, if it samples.
        Embedding chunks fold their pooled hidden states into their sequence instead; rows
        with logits processors are sampled again from their processed logits (``process``)."""
        for chunk in chunks:
            chunk.seq.draft_lag = 0  # a draft model computed the chunk too
        sampled = [(c.seq.seq_id, r) for r, c in enumerate(chunks) if c.samples and c.seq.embedding is None]
        embedded = [(c, r) for r, c in enumerate(chunks) if c.seq.embedding is not None]

        def collect() -> dict[int, list[SampleResult]]:
            fetched, hidden = jax.device_get((result, pooled))
            for chunk, r in embedded:
                chunk.seq.embedding.add_chunk(chunk.start, chunk.num_tokens, hidden.sums[r], hidden.last[r, 0],
                                              chunk.samples)
            if process is not None:
                fetched = process(fetched)
            return {seq_id: [_row(fetched, r)] for seq_id, r in sampled if seq_id not in self.processor_failures}

        return collect

    def _dispatch_decode(self, seqs: list[Sequence], num_steps: int) -> Callable[[], dict[int, list[SampleResult]]]:
        """``num_steps`` tokens for each sequence (fewer where its allocation ends).

        Rows round up to 1, 2, 4, ...: a decode step costs about its row count, so a single
        stream padded to 4 rows would pay for 4.
        """
        rows = bucket(len(seqs), 1, self.max_batch)
        width = self._width(seqs)
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        limits = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            tokens[r] = seq.token_at(seq.num_tokens - 1)
            positions[r] = seq.num_tokens - 1
            limits[r] = min(len(seq.block_ids) * self.block_size, seq.num_tokens - 1 + num_steps)
        sbatch, flags = self._sampling(seqs, rows)
        sink = self._hidden_sink(seqs + [None] * (rows - len(seqs)), positions[:, None])
        results, self.kv, hidden, logits = _decode_program(
            self.params, self.kv, tokens, positions, self._block_table(seqs, rows, width), limits, sbatch,
            config=self.config, num_steps=num_steps, cpu_kernels=self.cpu_kernels, **flags, **sink,
            **_logits_flag(seqs),
        )
        self._keep_hidden(hidden)
        process = self._processing(seqs, logits, sbatch, flags)

        def collect() -> dict[int, list[SampleResult]]:
            fetched = jax.device_get(results)
            if process is not None:  # one step (rows with processors decode one at a time)
                fetched = SampleResult(*(a[None] for a in process(_row(fetched, 0), 0)))
            out = {}
            for r, seq in enumerate(seqs):
                if seq.seq_id not in self.processor_failures:
                    steps = int(limits[r] - positions[r])
                    out[seq.seq_id] = [_row(fetched, (i, r)) for i in range(steps)]
            return out

        return collect

    def _dispatch_decode_step(
        self, seqs: list[Sequence], num_steps: int, guesses: Mapping[int, int]
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        """A plain decode, or a speculative one: a draft model's pool must see every token the
        target computes, so with one every decode goes through the speculative program (zero
        guesses when the scheduler allowed none); n-gram rows without a match decode plainly."""
        if self.speculative is None:
            return self._dispatch_decode(seqs, num_steps)
        limits = [self._draft_limit(seq, guesses.get(seq.seq_id, 0)) for seq in seqs]
        proposals: list[list[int]] | None = None
        if self.draft is None:
            spec = self.speculative
            proposals = [
                propose_ngram(seq.all_ids, k, spec.ngram_min, spec.ngram_max) if k else [] for seq, k in zip(seqs, limits)
            ]
            proposals = [p if seq.matcher is None else p[: accepted_prefix(seq.matcher, p)]
                         for seq, p in zip(seqs, proposals)]  # guesses the grammar refuses are dropped
            if not any(proposals):
                return self._dispatch_decode(seqs, 1)
            limits = [min(k, len(p)) for k, p in zip(limits, proposals)]
        return self._dispatch_spec(seqs, limits, proposals, self.speculative.num_speculative_tokens if any(limits) else 0)

    def _draft_limit(self, seq: Sequence, allowed: int) -> int:
        """Guesses ``seq`` carries: what the scheduler grew its blocks for (it already left out
        what max_tokens could not emit), checked against the blocks it holds."""
        room = len(seq.block_ids) * self.block_size - seq.num_tokens
        if allowed > room:
            raise AssertionError(f"sequence {seq.seq_id} was allowed {allowed} guesses but holds room for {room}")
        return allowed

    def _dispatch_spec(
        self, seqs: list[Sequence], limits: list[int], proposals: list[list[int]] | None, num_speculative: int
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        rows = bucket(len(seqs), 1, self.max_batch)
        K = num_speculative
        window_tokens = np.zeros((rows, 2), np.int32)
        window_positions = np.full((rows, 2), -1, np.int32)
        guesses = np.zeros((rows, K), np.int32)
        num_drafts = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            last = seq.num_tokens - 1
            first = last - (seq.draft_lag if self.draft is not None else 0)
            n = last - first + 1
            window_tokens[r, :n] = [seq.token_at(i) for i in range(first, last + 1)]
            window_positions[r, :n] = np.arange(first, last + 1)
            num_drafts[r] = limits[r]
            if proposals is not None:
                guesses[r, : limits[r]] = proposals[r][: limits[r]]
        table = self._block_table(seqs, rows, self._width(seqs))
        drafted = num_drafts.copy()  # what the draft model computes (its lag depends on it)
        draft_args, draft_config = self._draft_args, self._draft_config
        constrained = K > 0 and any(s.matcher is not None for s in seqs)
        if constrained and self.draft is not None:
            # Structured output rows: the draft proposes alone, the host checks its guesses
            # against the grammars, and the target verifies what they accept.
            proposed, self.draft.kv = _draft_program(
                self.draft.params, self.draft.kv, window_tokens, window_positions, num_drafts, table,
                draft_config=self.draft.config, num_speculative=K, cpu_kernels=self.cpu_kernels,
            )
            guesses = np.array(jax.device_get(proposed))
            for r, seq in enumerate(seqs):
                if seq.matcher is not None:
                    num_drafts[r] = accepted_prefix(seq.matcher, guesses[r, : num_drafts[r]])
            draft_args, draft_config = (None, None), None
        bitmasks = self._position_bitmasks(seqs, rows, guesses, num_drafts) if constrained else None
        sbatch, flags = self._sampling(seqs, rows, None if bitmasks is None else bitmasks[0])
        # Passed only when there are some: an argument given as None is another signature to
        # jit than one left out, and the warmed-up programs leave it out.
        masks = {} if bitmasks is None else {"position_bitmasks": bitmasks}
        samples, accepted, self.kv, draft_kv = _spec_decode_program(
            self.params, self.kv, *draft_args, window_tokens, window_positions, guesses, num_drafts, table, sbatch,
            config=self.config, draft_config=draft_config, num_speculative=K, cpu_kernels=self.cpu_kernels,
            **masks, **flags,
        )
        if draft_config is not None:
            self._set_draft_kv(draft_kv)

        def collect() -> dict[int, list[SampleResult]]:
            fetched, accepted_host = jax.device_get((samples, accepted))
            out = {}
            for r, seq in enumerate(seqs):
                a = int(accepted_host[r])
                self.spec_stats.record(int(num_drafts[r]), a)
                # The draft computed the window and its guesses but the last: after a fully
                # accepted run it is one token behind the target.
                seq.draft_lag = int(self.draft is not None and 0 < drafted[r] == a)
                out[seq.seq_id] = [_row(fetched, (j, r)) for j in range(a + 1)]
            return out

        return collect

    # -- warm-up ---------------------------------------------------------------------------------------
    def warmup_shapes(self, num_scheduler_steps: int) -> list[tuple[str, tuple[int, ...]]]:
        """Every (kind, bucket) the engine can hit when no request asks for logprobs or penalties."""
        widths = self._widths()
        shapes: list[tuple[str, tuple[int, ...]]] = []
        if self.cpu_kernels:
            shapes += [("packed", (n,)) for n in power_buckets(MIN_TOKEN_BUCKET, self.max_tokens_bucket)]
        else:
            for rows, length, width in itertools.product(
                power_buckets(1, self.max_batch), power_buckets(MIN_TOKEN_BUCKET, self.max_tokens_bucket), widths
            ):
                if rows <= max(1, self.max_tokens_bucket // length):
                    shapes.append(("prefill", (rows, length, width)))
        for steps in sorted({1, num_scheduler_steps}):
            for rows, width in itertools.product(power_buckets(1, self.max_batch), widths):
                shapes.append(("decode", (rows, width, steps)))
        if self.speculative is not None:
            # A draft model decodes with no guesses through its own program (K = 0) too.
            lookaheads = sorted({self.speculative.num_speculative_tokens} | ({0} if self.draft else set()))
            for rows, width, k in itertools.product(power_buckets(1, self.max_batch), widths, lookaheads):
                shapes.append(("spec", (rows, width, k)))
        shapes += [("copy", (n,)) for n in power_buckets(1, self.max_batch)]
        return shapes

    def warmup(self, num_scheduler_steps: int, progress: Callable[[Iterable], Iterable] = lambda x: x) -> int:
        """Compile every bucket ahead of traffic (writes only to the null block). Returns the count."""
        shapes = self.warmup_shapes(num_scheduler_steps)
        for kind, dims in progress(shapes):
            self._compile(kind, dims)
        return len(shapes)

    def _compile(self, kind: str, dims: tuple[int, ...]) -> None:
        rows = self._packed_rows(dims[0]) if kind == "packed" else dims[0]
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        if kind == "copy":
            self.kv = _copy_blocks(self.kv, zeros(rows), zeros(rows), cpu_kernels=self.cpu_kernels)
            return
        sbatch = build_sampling_batch([], rows, self.config.vocab_size, self.eos_ids, False)
        flags = dict(num_logprobs=0, with_penalties=False)
        draft = dict(draft_config=self._draft_config)
        if kind == "packed":
            (num_tokens,) = dims
            _, self.kv, draft_kv, _, _, _ = _packed_prefill_program(
                self.params, self.kv, *self._draft_args, zeros(num_tokens), np.full(num_tokens, -1, np.int32),
                zeros(num_tokens), zeros(rows, self.max_width), zeros(rows), sbatch, config=self.config, **draft,
                **flags,
            )
            self._set_draft_kv(draft_kv)
        elif kind == "prefill":
            _, length, width = dims
            _, self.kv, draft_kv, _, _, _ = _prefill_program(
                self.params, self.kv, *self._draft_args, zeros(rows, length), zeros(rows, length),
                zeros(rows, width), zeros(rows), sbatch, config=self.config, **draft, **flags,
            )
            self._set_draft_kv(draft_kv)
        elif kind == "spec":
            _, width, k = dims
            _, _, self.kv, draft_kv = _spec_decode_program(
                self.params, self.kv, *self._draft_args, zeros(rows, 2), np.full((rows, 2), -1, np.int32),
                zeros(rows, k), zeros(rows), zeros(rows, width), sbatch, config=self.config, num_speculative=k,
                cpu_kernels=self.cpu_kernels, **draft, **flags,
            )
            self._set_draft_kv(draft_kv)
        else:
            _, width, steps = dims
            _, self.kv, _, _ = _decode_program(
                self.params, self.kv, zeros(rows), zeros(rows), zeros(rows, width), zeros(rows), sbatch,
                config=self.config, num_steps=steps, cpu_kernels=self.cpu_kernels, **flags,
            )


def _cpu_kernels_run(mesh: Mesh, kv: KVCache) -> bool:
    """Whether the programs run the C++ CPU kernels (``forward``'s ``cpu_kernels``): the paged
    attention kernel built, a CPU backend, an unsharded replica (XLA cannot partition a custom
    call) and a pool dtype it reads. Projections then take the small-batch matmul kernel
    where it applies (``model.dense`` falls back to XLA's dot by itself)."""
    return (
        paged_decode.available()
        and jax.default_backend() == "cpu"
        and mesh.devices.size == 1
        and kv.dtype in paged_decode.SUPPORTED_POOL_DTYPES
    )


def _row(result: SampleResult, index: int | tuple[int, int]) -> SampleResult:
    """Row ``index`` of a fetched sample batch: ``r``, or ``(step, r)`` of a multi-token one."""
    return SampleResult(*(np.asarray(a)[index] for a in result))
