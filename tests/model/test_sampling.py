"""The reference sampler: filters checked against hand-computed distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.sampling import SimpleSampling, sample_token
from raylm.model.loaders.load import load_checkpoint
from tests.checkpoints import build_tiny_checkpoint

N = 6000


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, n=N) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.vmap(sample_token, in_axes=(None, 0, None, None, None))
    ids = draw(jnp.asarray(logits, jnp.float32), keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    return np.bincount(np.asarray(ids), minlength=len(logits)) / n


def test_temperature_matches_softmax():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    np.testing.assert_allclose(_draw(logits, temperature=0.7), expected, atol=0.025)


def test_top_k_keeps_k_largest():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    freq = _draw(logits, top_k=2)
    np.testing.assert_allclose(freq, [0, 4 / 7, 0, 3 / 7], atol=0.025)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # Sorted mass: 0.5, 0.3, 0.1, 0.1. With p=0.6 the first two tokens are kept (0.5 < 0.6).
    logits = np.log(np.array([0.1, 0.5, 0.1, 0.3]))
    freq = _draw(logits, top_p=0.6)
    np.testing.assert_allclose(freq, [0, 0.625, 0, 0.375], atol=0.025)
    assert _draw(logits, top_p=0.01)[1] == 1.0


def test_invalid_parameters():
    with pytest.raises(ValueError, match="temperature"):
        SimpleSampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SimpleSampling(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SimpleSampling(top_k=-2)


def test_seed_reproducible(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    generator = SingleSequenceGenerator(*load_checkpoint(path))
    prompt = [5, 6, 7, 8]

    def run(seed):
        return list(generator.generate(prompt, 20, SimpleSampling(temperature=1.0, top_p=0.95, seed=seed)))

    assert run(7) == run(7)
    assert run(7) != run(8)
