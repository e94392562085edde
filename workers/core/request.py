"""A request as the engine tracks it: its prompt and its ``n`` sequences (forks of the first)."""

from __future__ import annotations

import dataclasses

import numpy as np

from raylm.workers.core.sequence import Sequence


@dataclasses.dataclass
class StreamCursor:
    """How much of one sequence's output the request's stream has delivered."""

    chars: int = 0  # of its text; the rest is held back while it could start a stop string
    tokens: int = 0


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None  # the text, when the request came as text (echoed in its outputs)
    prompt_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    cursors: list[StreamCursor] = dataclasses.field(default_factory=list)  # one per sequence
    # Hidden-state extraction (n = 1): float32 [layers, positions, D], read once it finished.
    hidden_states: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.cursors = self.cursors or [StreamCursor() for _ in self.seqs]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
