"""The sampler's argmax against ``jnp.argmax``: ties, NaN, infinities, any shape; both the C++
kernel (2-D float32 on CPU, ``model.kernels.row_argmax``) and the two-reduction jnp formulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from raylm.model.kernels import row_argmax
from raylm.workers.runner.sampler import argmax, portable_argmax

_argmax = jax.jit(argmax)
_portable = jax.jit(portable_argmax)


def _check(logits: np.ndarray) -> None:
    want = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1))
    for implementation in (_argmax, _portable):
        got = np.asarray(implementation(jnp.asarray(logits)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def test_the_kernel_runs_where_it_is_built():
    if row_argmax.available():
        assert "raylm_argmax" in _argmax.lower(jnp.zeros((2, 50))).as_text()


def test_maxima_and_nans_in_each_rows_tail():
    logits = np.random.default_rng(1).standard_normal((6, 16 * 7 + 5)).astype(np.float32)
    logits[0, -1] = 9.0  # past the last whole group of sixteen
    logits[1, [-3, 17]] = 9.0  # a tie between the tail and a group
    logits[2, -2] = np.nan
    logits[3, [-1, 40]] = [np.nan, 9.0]
    logits[4, :] = -0.0
    logits[4, 30] = 0.0  # equal to -0.0: the first index wins
    _check(logits)


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
