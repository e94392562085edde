"""Runs a step's plan on the device: the replica's weights and KV pools, and the one place each
compiled program is launched.

``ModelRunner.execute`` takes a ``SchedulerOutput`` (plain data) and returns a
``RunnerOutput``; it never sees a sequence. Every kind of program is declared once, in
``_program_kinds``: the buckets it is compiled for and its launcher, the program's one call
site. Steps launch the buckets their rows take (``workers/runner/batch_inputs.py`` pads them);
``warmup`` launches every bucket with no rows, which compiles exactly the programs steps run
(padding writes only to the null block), and the persistent compilation cache keeps them
across restarts. ``compile`` compiles one such launch's program without running it, from
another thread while steps run (a served engine's background warm-up).

A step's programs (prefill groups, then the decode) are all dispatched before any result is
fetched: JAX runs them back to back on the device while the host waits once, so running
sequences never wait for a host round trip behind a prefill. Attention (prompt chunks and
decode tokens alike) goes through the CPU paged kernel where it can run
(``model.kernels.paged_decode``); its cost follows each query's real context, so programs then use
one block-table width instead of a bucket per width, and a step's prompt chunks are packed
back to back, one token per row (the kernel gives each token its own context), into one
call per token bucket instead of one per (rows, chunk length, width) bucket.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.flop_count import ModelFlops
from raylm.model.decoder.forward import PooledHidden
from raylm.model.decoder.kv_pool import GroupedKV, KVCache
from raylm.model.decoder.params import ModelParams
from raylm.model.runtime.buckets import bucket
from raylm.model.runtime.sharding import shard_params
from raylm.workers.core.hidden_states import HiddenStateCapture
from raylm.workers.core.speculation import SpeculativeConfig
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, ScheduledRow, SchedulerOutput
from raylm.workers.core.step_result import Collect, PooledChunk, RunnerOutput
from raylm.workers.runner.batch_inputs import (
    ShapeBuckets,
    block_table,
    decode_inputs,
    hidden_where,
    logits_flag,
    lora_slots,
    packed_prefill_inputs,
    pooling_args,
    prefill_inputs,
    sampling_inputs,
)
from raylm.workers.runner.expert_load import ExpertLoad
from raylm.workers.runner.logits_processing import Processing, processing
from raylm.workers.runner.lora_slots import LoraSlots
from raylm.workers.runner.platform_kernels import cpu_kernels_run, gpu_kernels_run
from raylm.workers.runner.programs import (
    copy_blocks_program,
    decode_program,
    packed_prefill_program,
    prefill_program,
    read_hidden,
)
from raylm.workers.runner.sampler import SampleResult, result_row
from raylm.workers.runner.speculative_launch import SpeculativeLaunch
from raylm.workers.runner.speculative_step import DraftModel
from raylm.workers.runner.warmup_order import compiled_first, first_packed_bucket, warmup_order

logger = logging.getLogger(__name__)


class _Compiled(Exception):
    """Ends a launch inside ``ModelRunner.compile`` once its program is compiled: nothing after
    the program's call (the pools it would return) may touch the runner from that thread."""


class ModelRunner(SpeculativeLaunch):
    """Owns the weights and the device KV pools of one replica and executes scheduler output."""

    def __init__(
        self,
        config: ModelConfig,
        params: ModelParams,
        kv: KVCache | GroupedKV,
        mesh: Mesh,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_ids: frozenset[int],
        speculative: SpeculativeConfig | None = None,
        draft: DraftModel | None = None,
        hidden_state_buffers: tuple[int, int] = (0, 0),
        lora_buffers: tuple[int, int, str | None] | None = None,
        gpu_attention: str = "pallas",
    ):
        self.config = config
        self.mesh = mesh
        self.params = shard_params(params, config, mesh)
        self.kv = kv
        self.block_size = kv.block_size
        self.eos_ids = eos_ids
        self.cpu_kernels = cpu_kernels_run(mesh, kv)
        self.gpu_kernels = gpu_kernels_run(mesh, kv, config, gpu_attention)
        # KV groups: one pool for every layer, or the full-attention and the sliding layers' own.
        self.num_kv_groups = 2 if isinstance(kv, GroupedKV) else 1
        self.buckets = ShapeBuckets.create(max_num_seqs, max_num_batched_tokens, max_model_len, self.block_size,
                                           self.cpu_kernels)
        self.speculative = speculative
        if draft is not None:
            draft = dataclasses.replace(draft, params=shard_params(draft.params, draft.config, mesh))
        self.draft = draft
        # Hidden-state extraction (workers/core/hidden_states.py): [slots, L + 1, max_tokens, D].
        slots, max_tokens = hidden_state_buffers
        self.hidden_buffers = jnp.zeros((slots, config.num_layers + 1, max_tokens, config.hidden_size), jnp.float32) \
            if slots else None
        # LoRA adapter slots: (max_loras, max_lora_rank, dtype or None for the model's), None when off.
        self.lora = None if lora_buffers is None else LoraSlots(
            config, mesh, self.params.final_norm.dtype, self.cpu_kernels, *lora_buffers)
        self.expert_load = ExpertLoad(config, mesh) if config.moe_layers else None
        # Packed prompt buckets a step must not launch (their programs wait in a served engine's
        # background warm-up): set by the engine.
        self.packed_unavailable: frozenset[int] = frozenset()
        self._compiling = threading.local()  # ``active`` on a thread inside ``compile``

    # -- the programs -----------------------------------------------------------------------------
    def _program_kinds(self, num_scheduler_steps: int) -> dict[str, tuple[list[tuple[int, ...]], Callable]]:
        """Every kind of program a step may launch: the buckets it is compiled for (when no
        request asks for logprobs, penalties, logits, grammars or hidden states, which are
        variants) and its launcher, called as ``launch(rows, *bucket)``."""
        b = self.buckets
        rows, widths = b.row_buckets(), b.widths()
        kinds: dict[str, tuple[list[tuple[int, ...]], Callable]] = {}
        if b.cpu_kernels:
            kinds["packed"] = ([(n,) for n in b.token_buckets()], self._launch_packed_prefill)
        else:
            kinds["prefill"] = ([(r, n, w) for r, n, w in itertools.product(rows, b.token_buckets(), widths)
                                 if b.prefill_row_fits(r, n)], self._launch_prefill)
        kinds["decode"] = ([(r, w, steps) for steps in sorted({1, num_scheduler_steps})
                            for r, w in itertools.product(rows, widths)], self._launch_decode)
        if self.speculative is not None:
            # A draft model decodes with no guesses through the speculative program (K = 0) too.
            lookaheads = sorted({self.speculative.num_speculative_tokens} | ({0} if self.draft else set()))
            kinds["spec"] = (list(itertools.product(rows, widths, lookaheads)), self._launch_spec)
        kinds["copy"] = ([(n, g) for n in rows for g in range(self.num_kv_groups)], self._launch_copy)
        return kinds

    def warmup_shapes(self, num_scheduler_steps: int) -> list[tuple[str, tuple[int, ...]]]:
        """Every (kind, bucket) the engine can hit when no request asks for a variant, in the
        order to compile them: first the ones a request alone takes (``first_warmup_shapes``
        of them: one row's decode, and its prompt chunks in the ``FIRST_PACKED_TOKENS`` bucket
        when they are packed, any length when not), then the larger packed buckets in
        ascending order, then the smaller ones, so a replica that serves while it compiles the
        rest (``workers/engine/async_engine.py``) rarely meets a cold one."""
        shapes = [(kind, dims) for kind, (shapes, _) in self._program_kinds(num_scheduler_steps).items()
                  for dims in shapes]
        return warmup_order(shapes, self.buckets.row_buckets()[0], self.first_packed_bucket())

    def first_warmup_shapes(self, num_scheduler_steps: int) -> int:
        """How many of ``warmup_shapes`` a served engine compiles before it serves."""
        smallest, first_packed = self.buckets.row_buckets()[0], self.first_packed_bucket()
        return sum(compiled_first(shape, smallest, first_packed) for shape in self.warmup_shapes(num_scheduler_steps))

    def first_packed_bucket(self) -> int:  # the one packed prompt bucket a served engine compiles before it serves
        return first_packed_bucket(self.buckets.token_buckets())

    def warmup(self, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
               progress: Callable[[Iterable], Iterable] = lambda x: x, lora_slots: bool = False) -> None:
        """Compile ``shapes`` ahead of traffic (launched with no rows: writes only to the null
        block; the results are not fetched), and with ``lora_slots`` the program that fills a
        LoRA slot (compiled on an empty slot 1: at start-up only, before any adapter is in it)."""
        kinds = self._program_kinds(num_scheduler_steps)
        for kind, dims in progress(shapes):
            kinds[kind][1]([], *dims)
        if lora_slots and self.lora is not None:
            self.lora.load(1, None)

    compiles_off_thread = True  # ``compile`` may run beside steps (a multi-host leader's launches must not)

    def compile(self, num_scheduler_steps: int, shape: tuple[str, tuple[int, ...]]) -> None:
        """Compile the program ``warmup`` would launch for ``shape`` without running it: safe on
        another thread while this one steps (it only reads the pools' shapes, even donated ones),
        and JAX keeps the program for the launch that meets the same arguments."""
        kind, dims = shape
        self._compiling.active = True
        try:
            self._program_kinds(num_scheduler_steps)[kind][1]([], *dims)
        except _Compiled:
            return
        finally:
            self._compiling.active = False
        raise AssertionError(f"launching {shape} called no program")

    def _run(self, program: Callable, *args: Any, **kwargs: Any) -> Any:
        """Where a launch calls its program; inside ``compile``, compile it for these arguments and
        end the launch (``_Compiled``)."""
        if getattr(self._compiling, "active", False):
            program.lower(*args, **kwargs).compile()
            raise _Compiled
        return program(*args, **kwargs)

    # -- a step -----------------------------------------------------------------------------------
    max_in_flight = 1  # plans the engine may start before it finishes one (a pipeline's: one per stage)

    def submit(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.execute(plan)  # (one replica's step runs at once: its output is what ``finish`` returns)

    def finish(self, output: RunnerOutput) -> RunnerOutput:
        return output

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one engine step: the plan's block copies, its prompt chunks, and
        ``num_decode_steps`` tokens for its decodes, or, with speculative decoding, each
        decode's last token and up to its ``guesses`` verified in one call. Every program is
        dispatched before the first result is fetched (one host wait per step)."""
        b = self.buckets
        for slot, adapter in plan.lora_loads:
            self.lora.load(slot, adapter)
        for group, copies in enumerate((plan.block_copies, plan.sliding_block_copies)):
            if copies:
                self._launch_copy(copies, bucket(len(copies), 1, max(b.max_batch, len(copies))), group)
        chunks, decodes = plan.prefills, plan.decodes
        if b.cpu_kernels:
            pending = [self._launch_packed_prefill(group, n)
                       for group, n in b.packed_groups(chunks, self.packed_unavailable)]
        else:
            pending = [self._launch_prefill(group, b.rows(len(group)), length, b.width([c.row for c in group]))
                       for group, length in b.prefill_groups(chunks)]
        if decodes:
            assert plan.num_decode_steps == 1 or not any(d.row.host_before_each_token for d in decodes), \
                "one step at a time"
            pending.append(self._launch_decode_step(decodes, plan.num_decode_steps))
        out = RunnerOutput()
        for collect in pending:
            collect(out)
        return out

    def _launch_copy(self, copies: list[tuple[int, int]], n: int, group: int = 0) -> None:
        """Copy blocks (copy-on-write) of KV group ``group`` in its pool, and in a draft model's
        (which reads the full-attention group's table) in the same program, padded to ``n`` with
        null-block self copies so the program count stays logarithmic."""
        src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
        if copies:
            src[: len(copies)], dst[: len(copies)] = zip(*copies)
        name = self.kv._fields[group] if isinstance(self.kv, GroupedKV) else None
        pools = (self.kv if name is None else getattr(self.kv, name),)
        if self.draft is not None and group == 0:
            pools += (self.draft.kv,)
        copied = self._run(copy_blocks_program, pools, src, dst, cpu_kernels=self.cpu_kernels)
        self.kv = copied[0] if name is None else self.kv._replace(**{name: copied[0]})
        if len(copied) > 1:
            self.draft.kv = copied[1]

    def _lora(self, slots: np.ndarray) -> dict[str, Any]:
        """A program's ``lora`` argument (slots, each row's slot); none when LoRA is off (None: another signature)."""
        return {} if self.lora is None else self.lora.batch(slots)

    def _launch_packed_prefill(self, chunks: list[ScheduledChunk], num_tokens: int) -> Collect:
        rows = self.buckets.packed_rows(num_tokens)
        seqs = [c.row for c in chunks]
        tokens, positions, token_rows, last_tokens = packed_prefill_inputs(chunks, num_tokens, rows)
        sbatch, flags = self._sampling(seqs, rows)
        token_seqs = [seqs[r] if p >= 0 else None for r, p in zip(token_rows, positions)]
        result, self.kv, draft_kv, pooled, hidden, logits, load = self._run(
            packed_prefill_program, self.params, self.kv, *self._draft_args, tokens, positions, token_rows,
            self._tables(seqs, rows, self.buckets.max_width), last_tokens, sbatch, config=self.config,
            draft_config=self._draft_config, **flags, **pooling_args(chunks, rows, token_rows),
            **self._hidden_sink(token_seqs, positions[:, None]), **logits_flag(seqs),
            **self._lora(lora_slots(seqs, rows)[token_rows]), **self._expert_load(), **self._stage_input((num_tokens, 1)),
        )
        self._keep(draft_kv, hidden, load)
        return self._collect_chunks(chunks, result, pooled, processing(
            seqs, logits, sbatch, flags, [c.samples for c in chunks]))

    def _launch_prefill(self, chunks: list[ScheduledChunk], rows: int, length: int, width: int) -> Collect:
        seqs = [c.row for c in chunks]
        tokens, positions, context = prefill_inputs(chunks, rows, length)
        sbatch, flags = self._sampling(seqs, rows)
        result, self.kv, draft_kv, pooled, hidden, logits, load = self._run(
            prefill_program, self.params, self.kv, *self._draft_args, tokens, positions,
            self._tables(seqs, rows, width), context, sbatch, config=self.config, draft_config=self._draft_config,
            gpu_kernels=self.gpu_kernels, **flags,
            **pooling_args(chunks, rows, np.arange(rows)[:, None].repeat(length, 1)),
            **self._hidden_sink(seqs, positions), **logits_flag(seqs), **self._lora(lora_slots(seqs, rows)),
            **self._expert_load(), **self._stage_input((rows, length)),
        )
        self._keep(draft_kv, hidden, load)
        return self._collect_chunks(chunks, result, pooled, processing(
            seqs, logits, sbatch, flags, [c.samples for c in chunks]))

    def _collect_chunks(self, chunks: list[ScheduledChunk], result: SampleResult, pooled: PooledHidden | None,
                        process: Processing | None) -> Collect:
        """Fetches a prefill call's samples: row ``r`` belongs to ``chunks[r]``, if it samples.
        Embedding chunks return their pooled hidden states instead; rows with logits
        processors are sampled again from their processed logits (``process``). A draft model
        computed the chunks too, so it is behind by nothing."""
        sampled = [(c.row.seq_id, r) for r, c in enumerate(chunks) if c.samples and not c.pools]
        embedded = [(c.row.seq_id, r) for r, c in enumerate(chunks) if c.pools]

        def collect(out: RunnerOutput) -> None:
            fetched, hidden = jax.device_get((result, pooled))
            for seq_id, r in embedded:
                out.pooled[seq_id] = PooledChunk(hidden.sums[r], hidden.last[r, 0])
            if process is not None:
                fetched = process(fetched, out)
            out.draft_lags.update((c.row.seq_id, 0) for c in chunks)
            out.samples.update((seq_id, [result_row(fetched, r)]) for seq_id, r in sampled
                               if seq_id not in out.processor_failures)

        return collect

    def _launch_decode(self, decodes: list[ScheduledDecode], rows: int, width: int, num_steps: int) -> Collect:
        """``num_steps`` tokens for each row (fewer where its blocks end)."""
        seqs = [d.row for d in decodes]
        tokens, positions, limits = decode_inputs(decodes, rows, num_steps, self.block_size)
        sbatch, flags = self._sampling(seqs, rows)
        results, self.kv, hidden, logits, load = self._run(
            decode_program, self.params, self.kv, tokens, positions, self._tables(seqs, rows, width), limits,
            sbatch, config=self.config, num_steps=num_steps, cpu_kernels=self.cpu_kernels,
            gpu_kernels=self.gpu_kernels, **flags,
            **self._hidden_sink(seqs, positions[:, None]), **logits_flag(seqs), **self._lora(lora_slots(seqs, rows)),
            **self._expert_load(), **self._stage_input((rows, 1)),
        )
        self._keep(None, hidden, load)
        process = processing(seqs, logits, sbatch, flags)

        def collect(out: RunnerOutput) -> None:
            fetched = jax.device_get(results)
            if process is not None:  # one step (rows with processors decode one at a time)
                fetched = SampleResult(*(a[None] for a in process(result_row(fetched, 0), out, 0)))
            for r, seq in enumerate(seqs):
                if seq.seq_id not in out.processor_failures:
                    out.samples[seq.seq_id] = [result_row(fetched, (i, r)) for i in range(int(limits[r] - positions[r]))]

        return collect

    # -- what the launches share ----------------------------------------------------------------
    def _tables(self, seqs: list[ScheduledRow], rows: int, width: int) -> np.ndarray:
        """The rows' block tables, one per KV group (``block_table``)."""
        return block_table(seqs, rows, width, self.num_kv_groups)

    def _sampling(self, seqs: list[ScheduledRow], rows: int, bitmask: np.ndarray | None = None) -> tuple:
        return sampling_inputs(seqs, rows, self.config.vocab_size, self.eos_ids, bitmask)

    def _expert_load(self) -> dict[str, Any]:
        """A program's ``expert_load`` argument (donated); none for a model without experts."""
        return {} if self.expert_load is None else self.expert_load.argument()

    def _stage_input(self, shape: tuple[int, int]) -> dict[str, Any]:
        """A program's ``hidden_in``: none here (a pipeline's last stage: workers/pipeline/)."""
        return {}

    def model_flops(self, config: ModelConfig) -> ModelFlops:  # (of the weights this runner holds)
        return ModelFlops.of(config, self.params)

    def take_expert_load(self) -> np.ndarray | None:  # tokens routed per (sparse layer, expert) since the last call
        return None if self.expert_load is None else self.expert_load.take()

    def _hidden_sink(self, seqs: list[ScheduledRow | None], positions: np.ndarray) -> dict[str, Any]:
        """The ``hidden_buffers`` / ``hidden_where`` arguments of a program (``hidden_where``);
        none (the program without them) when no row captures."""
        where = None if self.hidden_buffers is None else hidden_where(seqs, positions, self.hidden_buffers.shape[0])
        return {} if where is None else {"hidden_buffers": self.hidden_buffers, "hidden_where": where}

    def read_hidden_states(self, capture: HiddenStateCapture, num_tokens: int) -> np.ndarray:
        """A finished capture's requested layers, ``[layers, positions, D]`` (one transfer)."""
        count = capture.count(num_tokens)
        layers = read_hidden(self.hidden_buffers, np.int32(capture.slot), np.asarray(capture.layers, np.int32))
        return np.asarray(jax.device_get(layers))[:, :count].copy()

    @property
    def _draft_args(self) -> tuple:  # (params, kv) of the draft model, (None, None) without one
        return (self.draft.params, self.draft.kv) if self.draft else (None, None)

    @property
    def _draft_config(self) -> ModelConfig | None:
        return self.draft.config if self.draft else None

    def _keep(self, draft_kv: KVCache | None, hidden_buffers: jax.Array | None,
              expert_load: jax.Array | None) -> None:
        """A program's updated draft pool, hidden-state buffers and expert load (it was given
        them donated)."""
        if self.draft is not None and draft_kv is not None:
            self.draft.kv = draft_kv
        if hidden_buffers is not None:
            self.hidden_buffers = hidden_buffers
        if expert_load is not None:
            self.expert_load.counts = expert_load
