"""Beam search on top of the engine, as vLLM v1 does it: each step, every live beam is one
request for a single token with the top ``2 * beam_width`` logprobs; the best ``beam_width``
extensions by cumulative logprob live on. A beam's tokens are its prompt plus its path, so the
prefix cache holds what beams share: a beam forked from another reuses its blocks (they are
shared, copy-on-write, by the block manager) and each step computes only the new token's tail.
Finished beams (EOS, or ``max_tokens``) are ranked by ``cum_logprob / length ** length_penalty``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from raylm.model.text.tokenizer import Tokenizer
from raylm.workers.core.request_output import CompletionOutput
from raylm.workers.core.sampling_params import BeamSearchParams


@dataclasses.dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated so far
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS) or "length"

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(1, len(self.tokens)) ** length_penalty


class BeamSearch:
    """The beams of one prompt; ``advance`` takes each live beam's top next-token logprobs."""

    def __init__(self, params: BeamSearchParams, eos_ids: frozenset[int]):
        self.params = params
        self.eos_ids = eos_ids
        self.live: list[Beam] = [Beam(())]
        self.finished: list[Beam] = []

    @property
    def done(self) -> bool:
        return not self.live

    def advance(self, candidates: Iterable[Mapping[int, float]]) -> None:
        """``candidates[i]``: token -> logprob of live beam ``i``'s next token (its top few)."""
        width = self.params.beam_width
        grown = []
        for beam, logprobs in zip(self.live, candidates):
            best = sorted(logprobs.items(), key=lambda item: -item[1])[: 2 * width]
            grown += [Beam((*beam.tokens, token), beam.cum_logprob + logprob) for token, logprob in best]
        grown.sort(key=lambda b: -b.cum_logprob)
        self.live, kept = [], 0
        for beam in grown:  # the best ``width`` that go on; EOS endings before them finish
            if kept == width:
                break
            if not self.params.ignore_eos and beam.tokens[-1] in self.eos_ids:
                self.finished.append(dataclasses.replace(beam, finish_reason="stop"))
                continue
            kept += 1
            if len(beam.tokens) >= self.params.max_tokens:
                self.finished.append(dataclasses.replace(beam, finish_reason="length"))
            else:
                self.live.append(beam)

    def best(self) -> list[Beam]:
        """The ``beam_width`` best beams, finished or not, best first."""
        penalty = self.params.length_penalty
        return sorted(self.finished + self.live, key=lambda b: -b.score(penalty))[: self.params.beam_width]

    def outputs(self, tokenizer: Tokenizer | None) -> list[CompletionOutput]:
        """The best beams as completions (text decoded when a tokenizer is given)."""
        return [
            CompletionOutput(index=i, text=tokenizer.decode(b.tokens) if tokenizer else "", token_ids=list(b.tokens),
                             cumulative_logprob=b.cum_logprob, finish_reason=b.finish_reason or "length")
            for i, b in enumerate(self.best())
        ]
