"""A step's results as plain data: what the runner hands back to ``Scheduler.update_from_output``
(vLLM v1's ``ModelRunnerOutput``). The engine reads the runner through this alone, but for a
finished hidden-state capture, which it asks for once (``ModelRunner.read_hidden_states``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from raylm.workers.runner.sampler import SampleResult


@dataclasses.dataclass(frozen=True)
class PooledChunk:
    """An embedding chunk's final-normed hidden states: summed over its tokens, and its last token's."""

    sums: np.ndarray  # [D]
    last: np.ndarray  # [D]


@dataclasses.dataclass
class RunnerOutput:
    # Per sequence id, its samples in order: a decode's steps (a speculative step's accepted
    # guesses and the target's token after them), or the sample of a chunk that ends its prompt.
    # Absent: nothing sampled (a chunk inside the prompt, a failed logits processor).
    samples: dict[int, list[SampleResult]] = dataclasses.field(default_factory=dict)
    # Speculative rows that carried guesses: (guesses scored, guesses accepted).
    accepted: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    pooled: dict[int, PooledChunk] = dataclasses.field(default_factory=dict)  # embedding chunks
    # Sequences whose logits processor failed this step (seq_id -> error): their requests end.
    processor_failures: dict[int, str] = dataclasses.field(default_factory=dict)
    # Known tokens before the last one whose K/V the draft model has not computed, per sequence
    # it ran for (workers/runner/speculative_step.py).
    draft_lags: dict[int, int] = dataclasses.field(default_factory=dict)


Collect = Callable[[RunnerOutput], None]  # fetches a launched program's results into the step's output
