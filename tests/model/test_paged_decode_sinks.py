"""The C++ paged-decode kernel with attention sinks (gpt-oss: a logit per query head that joins
its softmax's denominator, with no value), against the jnp ``paged_attention`` and the naive
numpy path, on the cases of tests/model/test_paged_decode_kernel.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.config.model_config import AttentionSpec
from raylm.model.kernels import paged_decode
from tests.model.test_paged_decode_kernel import (
    _dequantized,
    _spec_case,
    jnp_reference,
    kernel,
    make_case,
    naive_reference,
    needs_kernel,
)


@needs_kernel
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 16], ids=["dh64", "dh16-scalar"])
def test_attention_sinks_match_references(pool_dtype, head_dim):
    """gpt-oss's attention sinks (a logit per query head in its softmax's denominator, no value)
    on a windowed layer: sinks far above every score (the head attends almost to nothing: its
    output must stay finite and tiny), far below (plain attention) and ordinary, on each pool
    kind, through the lane-tree (64) and scalar (16) head dims. Against the naive path in
    float64, the jnp path (not for bfloat16, whose jnp path rounds the probabilities), and
    the sink-less kernel, which they must move."""
    spec = AttentionSpec(0.3, window=21)
    sinks = jnp.asarray([30.0, -30.0, 0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0], jnp.float32)
    lens = (1, 20, 21, 22, 0, 37, 64)
    shape = dict(head_dim=head_dim, width=5, lens=lens, pool_dtype=pool_dtype)
    case = _spec_case(26, window=21, null=np.nan, **shape)
    got = kernel(case, 1, spec, sinks)
    values = _dequantized(case) if pool_dtype == "int8" else case
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, naive_reference(values, 1, spec, sinks), **tol)
    real = np.asarray(case["context_lens"]) > 0
    if pool_dtype != "bfloat16":
        finite = _spec_case(26, window=21, null=1e4, **shape)
        np.testing.assert_allclose(got[real], jnp_reference(finite, 1, spec, sinks)[real], **tol)
    assert np.all(got[~real] == 0) and np.all(np.abs(got[real][:, 0]) < 1e-6)
    without = kernel(case, 1, spec)
    np.testing.assert_allclose(got[:, 1], without[:, 1], **tol)  # a sink at -30 takes nothing
    assert not np.allclose(got[real][:, 2:], without[real][:, 2:], rtol=1e-3, atol=1e-3)


@needs_kernel
def test_decode_attention_passes_sinks_to_the_kernel():
    """``decode_attention`` lowers a layer with sinks to the kernel, with the kernel's result."""
    spec = AttentionSpec(64**-0.5, window=20)
    sinks = jnp.linspace(-2.0, 2.0, 9, dtype=jnp.float32)
    case = make_case(27, window=20)
    fn = functools.partial(paged_decode.decode_attention, layer=1, spec=spec, sinks=sinks)
    cpu = jax.jit(fn).trace(**case).lower(lowering_platforms=("cpu",)).as_text()
    assert "raylm_paged_decode_attention" in cpu
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(**case)), kernel(case, 1, spec, sinks))


@needs_kernel
def test_rejects_sinks_of_the_wrong_size():
    case = make_case(28)
    with pytest.raises(Exception, match="sinks must be"):
        kernel(case, 0, None, jnp.zeros(4, jnp.float32))
