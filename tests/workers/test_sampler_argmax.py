"""The sampler's two-reduction argmax against ``jnp.argmax``: ties, NaN, infinities, any shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from workers.sampler import argmax

_argmax = jax.jit(argmax)


def _check(logits: np.ndarray) -> None:
    got = np.asarray(_argmax(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))


def test_vocabulary_sized_rows():
    _check(np.random.default_rng(0).standard_normal((64, 49152)).astype(np.float32))


def test_ties_take_the_first_index():
    logits = np.zeros((3, 10), np.float32)
    logits[0, [2, 5]] = 1.0
    logits[1, :] = 7.0
    logits[2, [9, 0]] = -1.0  # a row whose maximum (0.0) is everywhere else
    _check(logits)
    assert np.asarray(_argmax(jnp.asarray(logits))).tolist() == [2, 0, 1]


def test_nan_infinities_and_fully_masked_rows():
    logits = np.zeros((4, 6), np.float32)
    logits[0, [1, 4]] = np.nan  # the first NaN wins, as in jnp.argmax
    logits[1, :] = -np.inf  # every token masked
    logits[2, 3] = np.inf
    logits[3, [0, 5]] = [np.inf, np.nan]
    _check(logits)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=40),
                  elements=st.sampled_from([0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan]) | st.floats(width=32)))
def test_matches_jnp_argmax(logits):
    _check(logits)
