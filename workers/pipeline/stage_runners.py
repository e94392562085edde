"""One pipeline stage's runner: a contiguous run of decoder layers, their weights and their part
of the paged KV pool.

Every stage runs the same step plan (the scheduler runs once per replica; the plan's block
tables hold for every stage, whose pools have as many blocks) and groups its prompt chunks and
decodes into the same program launches, in the same order (``ModelRunner.execute``): so the
``n``-th launch of one stage hands its residual stream to the ``n``-th launch of the next.

- ``HiddenStageRunner`` (every stage but the last) launches ``stage_program`` in place of each
  sampling program and keeps the residual stream it returns (``[B, S, D]``, the launch's own
  token layout), which ``run`` hands back as host arrays, in launch order.
- ``LastStageRunner`` is the replica's ``ModelRunner`` over the last layers: every program
  (sampling, logits processors, grammars, embeddings' pooling) runs as it does unpipelined, each
  taking the previous stage's hidden states in place of the token embeddings.

A step's plan reaches the stages as ``stage_plan``: the rows stripped of what only sampling reads
(the sequences' token lists, sampling parameters, grammar matchers: not needed, and a matcher
cannot be pickled to another process).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, ScheduledRow, SchedulerOutput
from raylm.workers.core.step_result import Collect, RunnerOutput
from raylm.workers.runner.batch_inputs import decode_inputs, lora_slots, packed_prefill_inputs, prefill_inputs
from raylm.workers.runner.model_runner import ModelRunner
from raylm.workers.runner.programs import stage_program

_NO_SAMPLING = SamplingParams()


@dataclasses.dataclass(frozen=True)
class StageSpan:
    """Stage ``index`` of ``count``: decoder layers ``[start, stop)``."""

    index: int
    count: int
    start: int
    stop: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def split_layers(num_layers: int, num_stages: int) -> list[StageSpan]:
    """Contiguous spans of ``num_layers`` over ``num_stages`` stages, as even as they go (the
    first stages take one more layer where they do not divide): each stage holds at least one."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} must be between 1 and the model's "
                         f"{num_layers} layers (each stage holds at least one)")
    base, extra = divmod(num_layers, num_stages)
    spans, start = [], 0
    for i in range(num_stages):
        stop = start + base + (i < extra)
        spans.append(StageSpan(i, num_stages, start, stop))
        start = stop
    return spans


def stage_plan(plan: SchedulerOutput, span: StageSpan) -> SchedulerOutput:
    """What a stage's runner reads of ``plan``: rows without token lists, sampling parameters
    or grammar matchers (one stripped row per sequence, shared by its chunks and decode), and
    LoRA adapters cut to the stage's layers."""
    rows: dict[int, ScheduledRow] = {}

    def row(r: ScheduledRow) -> ScheduledRow:
        if r.seq_id not in rows:
            rows[r.seq_id] = dataclasses.replace(r, params=_NO_SAMPLING, prompt_ids=(), output_ids=(), matcher=None)
        return rows[r.seq_id]

    return dataclasses.replace(
        plan,
        prefills=[dataclasses.replace(c, row=row(c.row)) for c in plan.prefills],
        decodes=[dataclasses.replace(d, row=row(d.row)) for d in plan.decodes],
        lora_loads=stage_lora_loads(plan, span),
        kv_writes=[],
    )


def stage_lora_loads(plan: SchedulerOutput, span: StageSpan) -> list:
    """The plan's LoRA slot fills with each adapter cut to the stage's layers."""
    return [(slot, None if adapter is None else adapter.layer_slice(span.start, span.stop))
            for slot, adapter in plan.lora_loads]


class HiddenStageRunner(ModelRunner):
    """A stage before the last (module docstring). ``params`` and ``config`` are the stage's
    own (``ModelConfig.layer_slice``)."""

    def __init__(self, *args: Any, first: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.first = first
        self._hidden_in: list[Any] | None = None  # the previous stage's, during ``run`` (None: warm-up)
        self._handoff: list[jax.Array] = []
        self.busy_seconds = 0.0  # spent in steps (a pipeline's bubbles are the rest of the wall time)

    def run(self, plan: SchedulerOutput, hidden: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        """Run the stage's layers over ``plan`` (a ``stage_plan``), the first stage from its
        tokens, the others from ``hidden`` (the previous stage's ``run``); return each launch's
        residual stream."""
        started = time.perf_counter()
        self._hidden_in, self._handoff = list(hidden), []
        try:
            self.execute(plan)
            if self._hidden_in:
                raise RuntimeError(f"{len(self._hidden_in)} hidden-state inputs left over: the stages' launches differ")
            return [np.asarray(h) for h in jax.device_get(self._handoff)]
        finally:
            self._hidden_in, self._handoff = None, []
            self.busy_seconds += time.perf_counter() - started

    def _forward(self, seqs: list[ScheduledRow], tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                 context: np.ndarray, slots: np.ndarray) -> Collect:
        """Launch the stage's layers over one launch's tokens (its layout, ``[B, S]``) and keep the
        residual stream."""
        hidden = None
        if not self.first:
            hidden = self._hidden_in.pop(0) if self._hidden_in is not None else \
                jnp.zeros((*tokens.shape, self.config.hidden_size), self.params.final_norm.dtype)
        x, self.kv, load = stage_program(
            self.params, self.kv, tokens, positions, tables, context, hidden, **self._lora(slots),
            **self._expert_load(), config=self.config, cpu_kernels=self.cpu_kernels)
        self._keep(None, None, load)
        self._handoff.append(x)
        return lambda out: None

    def _launch_packed_prefill(self, chunks: list[ScheduledChunk], num_tokens: int) -> Collect:
        rows = self.buckets.packed_rows(num_tokens)
        seqs = [c.row for c in chunks]
        tokens, positions, token_rows, _ = packed_prefill_inputs(chunks, num_tokens, rows)
        tables = self._tables(seqs, rows, self.buckets.max_width)[..., token_rows, :]
        context = np.where(positions >= 0, positions + 1, 0).astype(np.int32)
        return self._forward(seqs, tokens[:, None], positions[:, None], tables, context,
                             lora_slots(seqs, rows)[token_rows])

    def _launch_prefill(self, chunks: list[ScheduledChunk], rows: int, length: int, width: int) -> Collect:
        seqs = [c.row for c in chunks]
        tokens, positions, context = prefill_inputs(chunks, rows, length)
        return self._forward(seqs, tokens, positions, self._tables(seqs, rows, width), context,
                             lora_slots(seqs, rows))

    def _launch_decode_step(self, decodes: list[ScheduledDecode], num_steps: int) -> Collect:
        rows, width = self.buckets.rows(len(decodes)), self.buckets.width([d.row for d in decodes])
        return self._launch_decode(decodes, rows, width, num_steps)

    def _launch_decode(self, decodes: list[ScheduledDecode], rows: int, width: int, num_steps: int) -> Collect:
        assert num_steps == 1, "a pipeline's stages decode one step at a time"
        seqs = [d.row for d in decodes]
        tokens, positions, limits = decode_inputs(decodes, rows, 1, self.block_size)
        context = np.where(positions < limits, positions + 1, 0).astype(np.int32)
        return self._forward(seqs, tokens[:, None], positions[:, None], self._tables(seqs, rows, width), context,
                             lora_slots(seqs, rows))


class LastStageRunner(ModelRunner):
    """The last stage (module docstring): the replica's programs over its layers."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hidden_in: list[Any] | None = None  # the previous stage's, during ``execute_after`` (None: warm-up)
        self.busy_seconds = 0.0  # spent in steps

    def execute_after(self, plan: SchedulerOutput, hidden: Sequence[np.ndarray], span: StageSpan) -> RunnerOutput:
        """``execute`` of ``plan`` from the previous stage's residual streams ``hidden``."""
        started = time.perf_counter()
        self._hidden_in = list(hidden)
        try:
            out = self.execute(dataclasses.replace(plan, lora_loads=stage_lora_loads(plan, span)))
            if self._hidden_in:
                raise RuntimeError(f"{len(self._hidden_in)} hidden-state inputs left over: the stages' launches differ")
            return out
        finally:
            self._hidden_in = None
            self.busy_seconds += time.perf_counter() - started

    def _stage_input(self, shape: tuple[int, int]) -> dict[str, Any]:
        if self._hidden_in is None:  # warm-up: the programs' shapes
            return {"hidden_in": jnp.zeros((*shape, self.config.hidden_size), self.params.final_norm.dtype)}
        return {"hidden_in": self._hidden_in.pop(0)}
