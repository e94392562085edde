"""Single-row token sampling for the reference generate loop: greedy, temperature, top-k, top-p.

The engine has its own batched sampler; this one is deliberately plain so it can serve as
the reference the engine is checked against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SimpleSampling:
    """How to pick the next token. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.jit
def sample_token(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Sample one id from ``logits [V]`` after temperature, top-k and top-p (nucleus) filtering."""
    logits = logits.astype(jnp.float32) / temperature
    sorted_logits = jnp.sort(logits)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, logits.shape[0]), logits.shape[0])
    kth_largest = sorted_logits[k - 1]
    logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    # Nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p.
    sorted_probs = jax.nn.softmax(jnp.where(sorted_logits < kth_largest, -jnp.inf, sorted_logits))
    mass_before = jnp.cumsum(sorted_probs) - sorted_probs
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf))
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits)
