"""Embeddings: a request that wants its prompt's pooled hidden state instead of a completion.

It runs through the same scheduler and prefill programs as any prompt (batched with other
requests, chunked when long); the prefill programs also return each chunk's final-normed hidden
states summed, and its last token's (``model.decoder.forward.PooledHidden``), and the sequence ends
once its whole prompt is computed. ``mean`` pools every prompt token (so its prompt is computed
whole: a prefix-cache hit would skip tokens the mean needs); ``last`` takes the last token's,
which a cached prefix does not change. The result is L2-normalised, as OpenAI's embeddings are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

POOLING_METHODS = ("mean", "last")


@dataclasses.dataclass
class EmbeddingState:
    """The pooling of one sequence's prompt, accumulated chunk by chunk."""

    pooling: str
    total: np.ndarray | None = None  # float64 [D]: the hidden states summed so far
    count: int = 0
    vector: list[float] | None = None  # the normalised embedding, once the prompt is computed

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"embedding pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")

    @property
    def reuses_cached_prefix(self) -> bool:
        return self.pooling == "last"

    def add_chunk(self, start: int, num_tokens: int, chunk_sum: np.ndarray, last: np.ndarray, done: bool) -> None:
        """Fold in one computed chunk (``start`` 0 begins again: a preempted prompt is recomputed)."""
        if start == 0 or self.total is None:
            self.total, self.count = np.zeros(chunk_sum.shape, np.float64), 0
        self.total += chunk_sum
        self.count += num_tokens
        if done:
            pooled = self.total / self.count if self.pooling == "mean" else np.asarray(last, np.float64)
            norm = np.linalg.norm(pooled)
            self.vector = (pooled / norm if norm > 0 else pooled).astype(np.float32).tolist()
