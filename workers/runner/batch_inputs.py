"""Host-side batch assembly: a step's scheduled rows as the padded numpy arrays the compiled
programs take, and the shape buckets those arrays are padded to.

Shapes are static inside jit, so batch sizes, chunk lengths and block-table widths are
rounded up to powers of two (``ShapeBuckets``); padding rows and tokens write only to the
null block (position -1, or a context of 0). Everything here is numpy: jit transfers the
arrays with its arguments, and an empty batch padded to a bucket is what warm-up compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from raylm.model.runtime.buckets import bucket, cdiv, power_buckets
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, ScheduledRow
from raylm.workers.runner.grammar_masks import token_bitmask
from raylm.workers.runner.sampler import SamplingBatch, build_sampling_batch, logprobs_bucket

MIN_TOKEN_BUCKET = 16
MIN_WIDTH_BUCKET = 8
# What one more packed prefill call costs besides its tokens, in tokens: a call is split in two
# only where the two buckets save more padding than this (ShapeBuckets._least_padding).
CALL_COST_TOKENS = 2 * MIN_TOKEN_BUCKET


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """The buckets a replica's programs are compiled for, and which one a batch takes."""

    max_batch: int  # rows: 1, 2, 4, ... up to this
    max_tokens_bucket: int  # prompt tokens per call: 16, 32, ... up to this
    max_width: int  # block-table width: 8, 16, ... up to this
    cpu_kernels: bool  # attention by the CPU paged kernel: one width, prompt chunks packed

    @classmethod
    def create(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
               cpu_kernels: bool) -> ShapeBuckets:
        return cls(
            bucket(max_num_seqs, 1, 1 << 30), bucket(max_num_batched_tokens, MIN_TOKEN_BUCKET, 1 << 30),
            bucket(cdiv(max_model_len, block_size), MIN_WIDTH_BUCKET, 1 << 30), cpu_kernels,
        )

    def rows(self, n: int) -> int:
        """Rows round up to 1, 2, 4, ...: a decode step costs about its row count, so a single
        stream padded to 4 rows would pay for 4."""
        return bucket(n, 1, self.max_batch)

    def row_buckets(self) -> list[int]:
        return power_buckets(1, self.max_batch)

    def token_buckets(self) -> list[int]:
        return power_buckets(MIN_TOKEN_BUCKET, self.max_tokens_bucket)

    def widths(self) -> list[int]:
        """Block-table widths a program may use: the kernel's cost does not depend on the width,
        so it gets one (fewer programs to compile); the jnp path pays for the width, so buckets."""
        if self.cpu_kernels:
            return [self.max_width]
        return power_buckets(MIN_WIDTH_BUCKET, self.max_width)

    def width(self, rows: Sequence[ScheduledRow]) -> int:
        needed = min(max(len(r.block_ids) for r in rows), self.max_width)
        return next(w for w in self.widths() if w >= needed)

    def prefill_groups(self, chunks: list[ScheduledChunk]) -> list[tuple[list[ScheduledChunk], int]]:
        """Chunks a row each (the jnp path), grouped by chunk-length bucket (bounded padding),
        at most the token budget per call."""
        groups: dict[int, list[ScheduledChunk]] = {}
        for chunk in chunks:
            groups.setdefault(bucket(chunk.num_tokens, MIN_TOKEN_BUCKET, self.max_tokens_bucket), []).append(chunk)
        out = []
        for length, group in sorted(groups.items()):
            rows_cap = max(1, self.max_tokens_bucket // length)
            out += [(group[i : i + rows_cap], length) for i in range(0, len(group), rows_cap)]
        return out

    def prefill_row_fits(self, rows: int, length: int) -> bool:
        """Whether ``prefill_groups`` can make a call of ``rows`` chunks of ``length`` tokens."""
        return rows <= max(1, self.max_tokens_bucket // length)

    def packed_rows(self, num_tokens: int) -> int:
        """Chunks a packed prefill of ``num_tokens`` (a bucket) holds: one per 16 tokens, so the
        program count is one per token bucket and sampling pads at most 1/16 of the tokens."""
        return min(self.max_batch, max(1, num_tokens // MIN_TOKEN_BUCKET))

    def largest_token_bucket(self, unavailable: frozenset[int] = frozenset()) -> int:
        """The largest token bucket not in ``unavailable`` (programs a served engine has yet to compile)."""
        return max(n for n in self.token_buckets() if n not in unavailable)

    def packed_groups(self, chunks: list[ScheduledChunk], unavailable: frozenset[int] = frozenset()
                      ) -> list[tuple[list[ScheduledChunk], int]]:
        """Chunks packed back to back (the kernel path) into as few calls as the token budget
        and the chunks per call allow, each with the smallest token bucket that holds it, none
        of the ``unavailable`` ones (a served engine's programs still to compile; the chunks fit
        the largest bucket left, which the engine's chunk cap keeps them to); a call whose
        bucket would be mostly padding is split in two smaller ones (``_least_padding``)."""
        largest = self.largest_token_bucket(unavailable)
        groups: list[list[ScheduledChunk]] = []
        tokens = 0
        for chunk in chunks:
            assert chunk.num_tokens <= largest, (chunk.num_tokens, largest)
            full = tokens + chunk.num_tokens > largest
            if not groups or full or len(groups[-1]) == self.packed_rows(largest):
                groups.append([])
                tokens = 0
            groups[-1].append(chunk)
            tokens += chunk.num_tokens
        return [call for group in groups for call in self._least_padding(group, unavailable)]

    def _least_padding(self, group: list[ScheduledChunk], unavailable: frozenset[int]
                       ) -> list[tuple[list[ScheduledChunk], int]]:
        """``group`` as one call, or as the chunks a bucket of half its bucket holds and the
        rest (split the same way), when those calls' buckets add up to less than its bucket by
        more than a call's cost. Every padding token is a row of every matmul: 16 prompts of
        19 tokens (304) take 256 + 64 rows instead of 512."""
        whole = self._packed_bucket(group, unavailable)
        half, head, tokens = whole // 2, 0, 0
        while (head < len(group) and head < self.packed_rows(half)
               and tokens + group[head].num_tokens <= half):
            tokens += group[head].num_tokens
            head += 1
        if head in (0, len(group)):
            return [(group, whole)]
        first, rest = self._packed_bucket(group[:head], unavailable), self._least_padding(group[head:], unavailable)
        if first + sum(n + CALL_COST_TOKENS for _, n in rest) >= whole:
            return [(group, whole)]
        return [(group[:head], first), *rest]

    def _packed_bucket(self, group: list[ScheduledChunk], unavailable: frozenset[int]) -> int:
        need = sum(c.num_tokens for c in group)
        return next(n for n in self.token_buckets()
                    if n >= need and self.packed_rows(n) >= len(group) and n not in unavailable)


def block_table(rows: Sequence[ScheduledRow], num_rows: int, width: int, num_groups: int = 1) -> np.ndarray:
    """The rows' block tables, ``[num_rows, width]``, or ``[2, num_rows, width]`` for a model
    whose sliding layers keep a KV group of their own (the full-attention layers' first)."""
    table = np.zeros((num_groups, num_rows, width), np.int32)
    for r, row in enumerate(rows):
        for g, ids in enumerate((row.block_ids, row.sliding_block_ids)[:num_groups]):
            table[g, r, : len(ids)] = ids
    return table[0] if num_groups == 1 else table


def sampling_inputs(rows: Sequence[ScheduledRow], num_rows: int, vocab_size: int, eos_ids: frozenset[int],
                    bitmask: np.ndarray | None = None) -> tuple[SamplingBatch, dict]:
    """The rows' sampling batch and the program's sampling flags; structured output's bitmask
    is the next token's (``token_bitmask``) unless one is given."""
    params = [row.params for row in rows]
    with_penalties = any(p.uses_penalties for p in params)
    if bitmask is None:
        bitmask = token_bitmask(rows, num_rows, vocab_size)
    sbatch = build_sampling_batch(
        [(row.params, row.seed, len(row.output_ids), row.prompt_ids, row.output_ids) for row in rows],
        num_rows, vocab_size, eos_ids, with_penalties, bitmask,
    )
    return sbatch, dict(num_logprobs=logprobs_bucket(params), with_penalties=with_penalties)


def logits_flag(rows: Sequence[ScheduledRow]) -> dict:
    """A program returns its logits only when a row has logits processors (another variant)."""
    return {"return_logits": True} if any(row.params.logits_processors for row in rows) else {}


def lora_slots(rows: Sequence[ScheduledRow], num_rows: int) -> np.ndarray:
    """Each row's LoRA slot (0: the base model, and for padding rows)."""
    slots = np.zeros(num_rows, np.int32)
    slots[: len(rows)] = [row.lora_slot for row in rows]
    return slots


def hidden_where(rows: Sequence[ScheduledRow | None], positions: np.ndarray,
                 num_slots: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where a program writes the hidden states of token ``[b, s]`` (of ``rows[b]``, at
    ``positions[b, s]``): its capture's slot (``num_slots``, out of range: nowhere) and index
    there; None when no row captures."""
    if not any(row is not None and row.hidden_slot is not None for row in rows):
        return None
    slots = np.full(positions.shape, num_slots, np.int32)
    index = np.zeros(positions.shape, np.int32)
    for b, row in enumerate(rows):
        if row is not None and row.hidden_slot is not None:
            slots[b] = row.hidden_slot
            index[b] = positions[b] - row.hidden_start
    return slots, index


def pooling_args(chunks: list[ScheduledChunk], num_rows: int, token_rows: np.ndarray) -> dict:
    """A prefill program's arguments to pool embedding chunks' hidden states, none when no chunk
    is an embedding's: each token's segment is its chunk's row (``token_rows``), -1 for tokens
    of other chunks (padding tokens the program leaves out itself)."""
    embeds = [r for r, c in enumerate(chunks) if c.pools]
    if not embeds:
        return {}
    pooled = np.zeros(num_rows, bool)
    pooled[embeds] = True
    return dict(pool_segments=np.where(pooled[token_rows], token_rows, -1).astype(np.int32), num_pool_segments=num_rows)


def packed_prefill_inputs(chunks: list[ScheduledChunk], num_tokens: int,
                          num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chunks back to back, one token per row: tokens, positions (-1: padding), each token's
    chunk, and each chunk's last token."""
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.full(num_tokens, -1, np.int32)
    token_rows = np.zeros(num_tokens, np.int32)
    last_tokens = np.zeros(num_rows, np.int32)
    at = 0
    for r, chunk in enumerate(chunks):
        start, n = chunk.start, chunk.num_tokens
        tokens[at : at + n] = chunk.token_ids
        positions[at : at + n] = np.arange(start, start + n)
        token_rows[at : at + n] = r
        last_tokens[r] = at + n - 1
        at += n
    return tokens, positions, token_rows, last_tokens


def prefill_inputs(chunks: list[ScheduledChunk], num_rows: int,
                   length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks a row each: tokens ``[rows, length]``, their positions, each row's context length."""
    tokens = np.zeros((num_rows, length), np.int32)
    positions = np.zeros((num_rows, length), np.int32)
    context = np.zeros(num_rows, np.int32)
    for r, chunk in enumerate(chunks):
        start, n = chunk.start, chunk.num_tokens
        tokens[r, :n] = chunk.token_ids
        positions[r] = np.arange(start, start + length)
        context[r] = start + n
    return tokens, positions, context


def decode_inputs(decodes: list[ScheduledDecode], num_rows: int, num_steps: int,
                  block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's last known token, its position, and the position its writes stop at (its
    blocks' end, or ``num_steps`` on)."""
    tokens = np.zeros(num_rows, np.int32)
    positions = np.zeros(num_rows, np.int32)
    limits = np.zeros(num_rows, np.int32)
    for r, decode in enumerate(decodes):
        tokens[r] = decode.window[-1]
        positions[r] = decode.position
        limits[r] = min(len(decode.row.block_ids) * block_size, decode.position + num_steps)
    return tokens, positions, limits
