"""Custom logits processors: Python callables that rewrite a request's logits before each token.

``SamplingParams(logits_processors=[fn, ...])`` (offline; a function cannot cross HTTP), with
vLLM v0's signatures: ``fn(output_token_ids, logits) -> logits`` or ``fn(prompt_token_ids,
output_token_ids, logits) -> logits``, ``logits`` a float32 numpy array ``[vocab]``. They run
in order on the model's raw logits; penalties, ``logit_bias``, a grammar's mask and
``min_tokens`` then apply as for any request, and logprobs are those of the processed logits.

The sampler runs on the device, so a step with such a row also returns its logits: the host
runs the processors and samples the rows again from what they returned, with the row's own
random stream (seeded requests stay reproducible). Like structured output, those rows decode
one token per step, and they carry no speculative guesses (refused on a speculative engine).
A processor that raises or returns something else than ``[vocab]`` finite-or-inf floats
ends its request with ``finish_reason: "abort"``; the error is logged, other requests go on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

LogitsProcessor = Callable[..., np.ndarray]


class LogitsProcessorError(RuntimeError):
    """A request's logits processor failed; the request is aborted."""


def check_processors(processors: object) -> None:
    """ValueError unless ``processors`` is a list of callables taking 2 or 3 arguments."""
    if not isinstance(processors, (list, tuple)) or not processors:
        raise ValueError("logits_processors must be a non-empty list of callables")
    for fn in processors:
        if not callable(fn):
            raise ValueError(f"logits_processors entries must be callables, got {type(fn).__name__}")
        if _arity(fn) not in (2, 3):
            raise ValueError("a logits processor takes (output_token_ids, logits) or "
                             f"(prompt_token_ids, output_token_ids, logits); {fn!r} takes {_arity(fn)} arguments")


def _arity(fn: LogitsProcessor) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume vLLM's common form
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def apply_processors(processors: Sequence[LogitsProcessor], prompt_ids: list[int], output_ids: list[int],
                     logits: np.ndarray) -> np.ndarray:
    """``logits [V]`` after each processor in turn; LogitsProcessorError naming what went wrong."""
    for fn in processors:
        try:
            args = (list(prompt_ids), list(output_ids)) if _arity(fn) == 3 else (list(output_ids),)
            out = np.asarray(fn(*args, logits.copy()), dtype=np.float32)
        except Exception as err:  # the user's code: any failure ends only its request
            raise LogitsProcessorError(f"logits processor {fn!r} raised {err!r}") from err
        if out.shape != logits.shape or np.isnan(out).any():
            raise LogitsProcessorError(f"logits processor {fn!r} returned shape {out.shape} (NaNs: "
                                       f"{bool(np.isnan(out).any())}); it must return the [{logits.shape[0]}] "
                                       "logits it was given, changed")
        logits = out
    return logits
