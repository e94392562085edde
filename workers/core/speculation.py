"""Speculative decoding settings, the n-gram (prompt lookup) proposer and acceptance counters.

A proposer guesses the next ``k`` tokens of a sequence; the target model scores the last
token and the ``k`` guesses in one call and keeps the longest prefix of guesses that equals
what it samples itself (``workers/runner/speculative_step.py`` runs the step, and keeps a draft model's
pool in step with the target's: the sequence's ``draft_lag``). Both proposers here
are deterministic (the draft model proposes its argmax), so a guess is a one-hot proposal
distribution ``q``: Leviathan et al.'s rule then accepts ``d`` with probability ``p(d)`` and,
on rejection, samples from ``p`` with ``d`` removed. Sampling the target's own token ``t ~ p``
with the row's usual random stream and accepting exactly when ``t == d`` is that rule (P[accept]
is ``p(d)``; given a rejection ``t`` is distributed as ``p`` without ``d``) and emits the very
token plain decoding would have: output with speculation is the output without it, sampled or
greedy, seeded or not.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping
from typing import Sequence as SequenceOf

import numpy as np

if TYPE_CHECKING:
    from raylm.model.loaders.load import LoadedModel

METHODS = ("draft", "ngram")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``engine.speculative`` in the deploy file, ``LLM(speculative={...})``.

    ``method: draft`` runs a draft model inside the replica: ``model`` names one (registry
    name, GGUF file or HF directory sharing the target's tokenizer; offline, also a
    ``LoadedModel`` already in memory, as a training script has it), or, left out, the draft
    is derived from the target: its first ``num_layers`` layers (layer skipping) with
    ``quantization`` applied; a bundled model has a measured default (``model.config.registry``).
    ``method: ngram`` looks the sequence's last ``ngram_max``..``ngram_min`` tokens up in its
    own earlier tokens and proposes what followed (no model). Above ``disable_by_batch_size``
    running sequences a step decodes normally.
    """

    method: str = "draft"
    model: "str | LoadedModel | None" = None
    num_layers: int | None = None
    quantization: str | None = None
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative.num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative.ngram needs 1 <= min <= max, got min={self.ngram_min} max={self.ngram_max}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"speculative.num_layers must be >= 1, got {self.num_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method == "ngram" and (self.model or self.num_layers or self.quantization):
            raise ValueError("speculative.method ngram takes no draft model (model, num_layers, quantization)")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """From the deploy file's / ``LLM``'s mapping (``ngram: {min, max}`` nested), or as is."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        raw = dict(value)
        ngram = raw.pop("ngram", None) or {}
        unknown = set(ngram) - {"min", "max"}
        if unknown:
            raise ValueError(f"speculative.ngram takes min and max, got {sorted(unknown)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise ValueError(f"unknown speculative setting(s) {unknown}; known: {sorted(fields - {'ngram_min', 'ngram_max'}) + ['ngram']}")
        if "min" in ngram:
            raw["ngram_min"] = ngram["min"]
        if "max" in ngram:
            raw["ngram_max"] = ngram["max"]
        return cls(**raw)


def propose_ngram(token_ids: SequenceOf[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, trying n from ``ngram_max`` down to ``ngram_min``; [] if none."""
    ids = np.asarray(token_ids, np.int64)
    total = ids.shape[0]
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = ids[total - n :]
        # Windows starting at 0 .. total-n-1 (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(ids[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


@dataclasses.dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's ``spec_decode`` metrics): draft tokens scored, how many the
    target accepted, and acceptances by position in the draft."""

    num_drafts: int = 0  # verify rows that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify row that had any."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
