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

import functools
import itertools
import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model import KVCache, ModelConfig, ModelParams, forward, paged_decode, shard_params
from workers.sampler import SampleResult, SamplingBatch, advance, build_sampling_batch, logprobs_bucket, sample
from workers.scheduler import ScheduledChunk
from workers.sequence import Sequence

MIN_TOKEN_BUCKET = 16
MIN_WIDTH_BUCKET = 8


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n (at least ``minimum``), capped at ``maximum``."""
    return min(maximum, max(minimum, 1 << max(0, math.ceil(math.log2(max(1, n))))))


def power_buckets(minimum: int, maximum: int) -> list[int]:
    out, b = [], bucket(1, minimum, maximum)
    while True:
        out.append(b)
        if b >= maximum:
            return out
        b = min(maximum, b * 2)


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_logprobs", "with_penalties"),
    donate_argnames=("kv",),
)
def _prefill_program(params, kv, tokens, positions, block_tables, context_lens, sbatch, *, config,
                     num_logprobs, with_penalties):
    """Prompt chunks a row each (``tokens [B, S]``), attention by the jnp path (see
    ``_packed_prefill_program`` for the kernel's)."""
    logits, kv = forward(params, config, tokens, positions, kv, block_tables, context_lens)
    return sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_logprobs", "with_penalties"),
    donate_argnames=("kv",),
)
def _packed_prefill_program(params, kv, tokens, positions, token_rows, block_tables, last_tokens, sbatch, *,
                            config, num_logprobs, with_penalties):
    """Prompt chunks packed one token per row (``tokens [T]``, padding at position -1), attention
    by the paged kernel; ``token_rows [T]`` picks each token's chunk in ``block_tables [R, P]``
    and ``last_tokens [R]`` each chunk's last token, whose logits are sampled."""
    context_lens = jnp.where(positions >= 0, positions + 1, 0)
    logits, kv = forward(params, config, tokens[:, None], positions[:, None], kv, block_tables[token_rows],
                         context_lens, cpu_kernels=True, logits_rows=last_tokens)
    return sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties), kv


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_steps", "num_logprobs", "with_penalties", "cpu_kernels"),
    donate_argnames=("kv",),
)
def _decode_program(params, kv, tokens, positions, block_tables, limits, sbatch, *, config, num_steps,
                    num_logprobs, with_penalties, cpu_kernels):
    """``num_steps`` decode steps with sampling in one call; rows stop writing at ``limits``."""

    def step(carry, _):
        kv, tokens, positions, sbatch = carry
        context_lens = jnp.where(positions < limits, positions + 1, 0)
        logits, kv = forward(params, config, tokens[:, None], positions[:, None], kv, block_tables, context_lens,
                             cpu_kernels=cpu_kernels)
        result = sample(logits, sbatch, num_logprobs=num_logprobs, with_penalties=with_penalties)
        return (kv, result.tokens, positions + 1, advance(sbatch, result.tokens)), result

    (kv, *_), results = jax.lax.scan(step, (kv, tokens, positions, sbatch), None, length=num_steps)
    return results, kv


@functools.partial(jax.jit, donate_argnames=("kv",))
def _copy_blocks(kv: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy blocks ``src`` to ``dst`` in every layer (a quantized pool's scales with its values)."""
    return jax.tree.map(lambda pool: pool.at[:, dst].set(pool[:, src]), kv)


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
    ):
        self.config = config
        self.mesh = mesh
        self.params = shard_params(params, config, mesh)
        self.kv = kv
        self.block_size = kv.block_size
        self.eos_ids = eos_ids
        self.max_batch = bucket(max_num_seqs, 1, 1 << 30)
        self.max_tokens_bucket = bucket(max_num_batched_tokens, MIN_TOKEN_BUCKET, 1 << 30)
        self.max_width = bucket(math.ceil(max_model_len / self.block_size), MIN_WIDTH_BUCKET, 1 << 30)
        self.cpu_kernels = _cpu_kernels_run(mesh, kv)

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

    def _sampling(self, seqs: list[Sequence], rows: int) -> tuple[SamplingBatch, dict]:
        params = [s.params for s in seqs]
        with_penalties = any(p.uses_penalties for p in params)
        sbatch = build_sampling_batch(
            [(s.params, s.seed, len(s.output_ids), s.prompt_ids, s.output_ids) for s in seqs],
            rows, self.config.vocab_size, self.eos_ids, with_penalties,
        )
        flags = dict(num_logprobs=logprobs_bucket(params), with_penalties=with_penalties)
        return sbatch, flags

    # -- execution ------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = zip(*copies)
            n = bucket(len(copies), 1, max(self.max_batch, len(copies)))
            # Pad with null-block self copies so the program count stays logarithmic.
            src_arr = np.zeros(n, np.int32)
            dst_arr = np.zeros(n, np.int32)
            src_arr[: len(src)], dst_arr[: len(dst)] = src, dst
            self.kv = _copy_blocks(self.kv, src_arr, dst_arr)

    def execute(
        self, chunks: list[ScheduledChunk], seqs: list[Sequence], num_steps: int
    ) -> dict[int, list[SampleResult]]:
        """Run one engine step: prompt chunks and ``num_steps`` decode tokens for ``seqs``.

        Every program is dispatched before the first result is fetched (one host wait per
        step). Returns, per sequence id, the samples of its decode steps and, for a chunk that
        reaches its sequence's last known token, that chunk's sample.
        """
        if self.cpu_kernels:
            pending = [self._dispatch_packed_prefill(group, n) for group, n in self._packed_groups(chunks)]
        else:
            pending = [self._dispatch_prefill(group, length) for group, length in self._prefill_groups(chunks)]
        if seqs:
            pending.append(self._dispatch_decode(seqs, num_steps))
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
            start, n = chunk.seq.num_computed_tokens, chunk.num_tokens
            tokens[at : at + n] = chunk.seq.all_ids[start : start + n]
            positions[at : at + n] = np.arange(start, start + n)
            token_rows[at : at + n] = r
            last_tokens[r] = at + n - 1
            at += n
        sbatch, flags = self._sampling(seqs, rows)
        result, self.kv = _packed_prefill_program(
            self.params, self.kv, tokens, positions, token_rows, self._block_table(seqs, rows, self.max_width),
            last_tokens, sbatch, config=self.config, **flags,
        )
        return self._collect_chunks(chunks, result)

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
            start, n = chunk.seq.num_computed_tokens, chunk.num_tokens
            tokens[r, :n] = chunk.seq.all_ids[start : start + n]
            positions[r] = np.arange(start, start + length)
            context[r] = start + n
        sbatch, flags = self._sampling(seqs, rows)
        result, self.kv = _prefill_program(
            self.params, self.kv, tokens, positions, self._block_table(seqs, rows, width), context, sbatch,
            config=self.config, **flags,
        )
        return self._collect_chunks(chunks, result)

    @staticmethod
    def _collect_chunks(
        chunks: list[ScheduledChunk], result: SampleResult
    ) -> Callable[[], dict[int, list[SampleResult]]]:
        """Fetches a prefill call's samples: row ``r`` belongs to ``chunks[r]``, if it samples."""
        sampled = [(c.seq.seq_id, r) for r, c in enumerate(chunks) if c.samples]

        def collect() -> dict[int, list[SampleResult]]:
            fetched = jax.device_get(result)
            return {seq_id: [_row(fetched, r)] for seq_id, r in sampled}

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
        results, self.kv = _decode_program(
            self.params, self.kv, tokens, positions, self._block_table(seqs, rows, width), limits, sbatch,
            config=self.config, num_steps=num_steps, cpu_kernels=self.cpu_kernels, **flags,
        )

        def collect() -> dict[int, list[SampleResult]]:
            fetched = jax.device_get(results)
            out = {}
            for r, seq in enumerate(seqs):
                steps = int(limits[r] - positions[r])
                out[seq.seq_id] = [_row(jax.tree_util.tree_map(lambda a: a[i], fetched), r) for i in range(steps)]
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
            self.kv = _copy_blocks(self.kv, zeros(rows), zeros(rows))
            return
        sbatch = build_sampling_batch([], rows, self.config.vocab_size, self.eos_ids, False)
        flags = dict(num_logprobs=0, with_penalties=False)
        if kind == "packed":
            (num_tokens,) = dims
            _, self.kv = _packed_prefill_program(
                self.params, self.kv, zeros(num_tokens), np.full(num_tokens, -1, np.int32), zeros(num_tokens),
                zeros(rows, self.max_width), zeros(rows), sbatch, config=self.config, **flags,
            )
        elif kind == "prefill":
            _, length, width = dims
            _, self.kv = _prefill_program(
                self.params, self.kv, zeros(rows, length), zeros(rows, length), zeros(rows, width), zeros(rows),
                sbatch, config=self.config, **flags,
            )
        else:
            _, width, steps = dims
            _, self.kv = _decode_program(
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


def _row(result: SampleResult, r: int) -> SampleResult:
    return SampleResult(*(np.asarray(a)[r] for a in result))
