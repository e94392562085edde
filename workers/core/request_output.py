"""What the engine hands back per request, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

import dataclasses

import numpy as np

# One position's logprobs: token id -> logprob (the sampled token always included).
TokenLogprobs = dict[int, float]


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request (cumulative; ``*_delta`` for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = dataclasses.field(default_factory=list)
    # SamplingParams.return_hidden_states, in the final output: float32 [layers, positions, D]
    hidden_states: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # time.monotonic() stamps for metrics (vLLM keeps these in RequestOutput.metrics)
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    embedding: list[float] | None = None  # embedding requests: the pooled, normalised prompt
