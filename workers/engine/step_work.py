"""Per step kind, what an engine's model steps computed and how long they took: the achieved
GFLOP/s that ``raylm bench`` reports against the machine's float32 GEMM peak.

A step is one ``ModelRunner.execute``: its programs launched back to back and their results
fetched once, which is the device sync the runner does anyway, so its wall time is the
programs' (with the host's input building and launches, which they overlap). Kinds:

- ``prefill``: prompt chunks only;
- ``decode``: decode rows only (one token each, or ``num_scheduler_steps`` in one call);
- ``mixed``: prompt chunks and decode rows in one step (chunked prefill beside running sequences);
- ``verify``: speculative decoding scored guesses (the target's last token and guesses per
  row, after the draft model proposed them); prompt chunks of the same step count with it.

A step's operations are the target model's over the tokens it computed, plus a draft model's
(it computes every prompt chunk with the target, and in a speculative step each row's window
and its guesses but the last; its prompt logits are thrown away and not counted), as
``model/decoder/flop_count.py`` counts them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from raylm.model.decoder.flop_count import ModelFlops
from raylm.workers.core.engine_stats import ComputeStats, StepWork
from raylm.workers.core.step_plan import SchedulerOutput
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.runner.batch_inputs import decode_inputs

STEP_KINDS: tuple[str, ...] = ("prefill", "decode", "mixed", "verify")


@dataclasses.dataclass
class _Runs:
    """Runs of consecutive positions a model computes in a step, and its logits rows."""

    starts: list[int] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)
    logit_rows: int = 0

    def add(self, start: int, count: int, logit_rows: int) -> None:
        self.starts.append(start)
        self.counts.append(count)
        self.logit_rows += logit_rows

    def flops(self, model: ModelFlops) -> int:
        return model.flops(self.logit_rows, np.asarray(self.starts), np.asarray(self.counts))


def step_kind(plan: SchedulerOutput, output: RunnerOutput) -> str:
    """The kind (``STEP_KINDS``) of a step that ran ``plan`` and returned ``output``."""
    if any(guesses for guesses, _ in output.accepted.values()):
        return "verify"
    if plan.prefills:
        return "mixed" if plan.decodes else "prefill"
    return "decode"


def step_work(plan: SchedulerOutput, output: RunnerOutput, block_size: int, target: ModelFlops,
              draft: ModelFlops | None) -> tuple[int, int]:
    """(tokens the target computed, operations of the target and the draft model) of a step.
    A decode row computes ``num_decode_steps`` positions, fewer where its blocks end (what the
    runner computes too: ``decode_inputs``); a speculative row its last token and the guesses
    it was scored on (``output.accepted``)."""
    model, proposer = _Runs(), _Runs()
    for chunk in plan.prefills:
        model.add(chunk.start, chunk.num_tokens, 1)
        proposer.add(chunk.start, chunk.num_tokens, 0)
    speculative = [d for d in plan.decodes if d.row.seq_id in output.accepted]
    for decode in speculative:
        guesses = output.accepted[decode.row.seq_id][0]
        model.add(decode.position, 1 + guesses, 1 + guesses)
        window = len(decode.window)
        proposer.add(decode.position - window + 1, window, 1)
        proposer.add(decode.position + 1, max(0, guesses - 1), max(0, guesses - 1))
    plain = [d for d in plan.decodes if d.row.seq_id not in output.accepted]
    if plain:
        _, positions, limits = decode_inputs(plain, len(plain), plan.num_decode_steps, block_size)
        for position, limit in zip(positions.tolist(), limits.tolist()):
            model.add(position, limit - position, limit - position)
    flops = model.flops(target) + (proposer.flops(draft) if draft is not None else 0)
    return sum(model.counts), flops


class StepCounters:
    """An engine's lifetime ``StepWork`` per step kind."""

    def __init__(self, block_size: int, target: ModelFlops, draft: ModelFlops | None, integer_matmuls: bool):
        self.block_size, self.target, self.draft = block_size, target, draft
        self.integer_matmuls = integer_matmuls
        self.kinds = {kind: StepWork() for kind in STEP_KINDS}

    def add(self, plan: SchedulerOutput, output: RunnerOutput, seconds: float) -> None:
        """Count a step that ran ``plan`` in ``seconds`` (a step that only filled LoRA slots
        computed nothing and is not a step of any kind)."""
        if not plan.prefills and not plan.decodes:
            return
        kind = step_kind(plan, output)
        tokens, flops = step_work(plan, output, self.block_size, self.target, self.draft)
        work = self.kinds[kind]
        self.kinds[kind] = StepWork(work.steps + 1, work.tokens + tokens, work.seconds + seconds, work.flops + flops)

    def stats(self) -> ComputeStats:
        return ComputeStats(self.integer_matmuls, dict(self.kinds))
