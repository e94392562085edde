"""A request as the engine tracks it: its prompt and its ``n`` sequences (forks of the first)."""

from __future__ import annotations

import dataclasses

from workers.sequence import Sequence


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None  # the text, when the request came as text (echoed in its outputs)
    prompt_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
