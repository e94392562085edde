"""Per-request sampling and beam-search parameters, validated up front with errors that name
the field. Plain data: the router builds them and they cross Ray inside a ``GenerateRequest``.

Shaped like vLLM's ``SamplingParams`` / ``BeamSearchParams`` so code moving from vLLM keeps working.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.logits_processors import LogitsProcessor, check_processors

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
_INT32_MAX = 2**31 - 1  # the sampler's per-row arrays are int32: a larger value would fail a whole batch


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and the allowed range."""


@dataclasses.dataclass
class SamplingParams:
    """How to generate: length limits, randomness, penalties, stops, logprobs, fan-out."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 disable
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (the sampled one always included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    structured_output: StructuredOutput | None = None  # a grammar the output must follow
    # Hidden states of these layers (HF's numbering: 0 embeddings .. L final-normed output)
    # for every generated token, and the prompt's with ``hidden_states_include_prompt``
    # (workers/core/hidden_states.py): ``CompletionOutput.hidden_states [layers, positions, D]``.
    return_hidden_states: Sequence[int] | None = None
    hidden_states_include_prompt: bool = False
    # Offline only: callables rewriting the logits before each token (workers/core/logits_processors.py).
    logits_processors: Sequence[LogitsProcessor] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise SamplingParamsError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= _INT32_MAX,
              f"min_tokens must be in [0, {_INT32_MAX}], got {self.min_tokens!r}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        check(isinstance(self.top_k, int) and 0 <= self.top_k <= _INT32_MAX,
              f"top_k must be -1, 0 (disabled) or in [1, {_INT32_MAX}], got {self.top_k!r}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        check(all(isinstance(t, int) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids),
              f"stop_token_ids must be ids in [0, {_INT32_MAX}]")
        bias = self.logit_bias or {}
        check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS,
              f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
        check(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32_MAX for t in bias),
              f"logit_bias keys must be token ids in [0, {_INT32_MAX}]")
        check(all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and -100 <= b <= 100
                  for b in bias.values()), "logit_bias values must be numbers in [-100, 100]")
        check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
              "structured_output must be a StructuredOutput")
        layers = self.return_hidden_states
        check(layers is None or (isinstance(layers, (list, tuple)) and 0 < len(layers) <= 1024
                                 and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)),
              "return_hidden_states must be a non-empty list of layer indices")
        check(isinstance(self.hidden_states_include_prompt, bool), "hidden_states_include_prompt must be a boolean")
        if self.logits_processors is not None:
            try:
                check_processors(self.logits_processors)
            except ValueError as err:
                raise SamplingParamsError(str(err)) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """Beam search instead of sampling (workers/engine/beam_search.py runs it): ``beam_width``
    completions, the best by length-penalized cumulative logprob, as vLLM's namesake."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_LOGPROBS // 2):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    def step_params(self) -> SamplingParams:
        """One token per beam per step, with the candidates' logprobs."""
        return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * self.beam_width, ignore_eos=True)
