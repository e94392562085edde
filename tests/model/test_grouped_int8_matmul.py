"""The integer mode's grouped kernel (a mixture of experts' experts, model/kernels/int8_matmul.py
``int8_grouped_matmul``) against the kernel on each expert alone and the NumPy model of the scheme.

Stacked experts are packed expert by expert (``pack_int8_experts``): expert ``e``'s slice of the
stack must be ``pack_int8_panels`` of its matrix, and the stack must dequantize to the stored
experts. Routing: consecutive groups with empty experts between them and padding rows after.
Each routed row must be, bit for bit, ``int8_matmul`` of that row alone against its expert's
packed matrix (the same loop nest, and a row's result does not depend on the batch), and equal
to tests/model/test_int8_matmul.py's step-by-step NumPy model of the scheme on the expert's
stored blocks (whose module docstring says why equal, not close); padding rows are zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from raylm.model.kernels import int8_matmul
from raylm.model.kernels.grouped_matmul import grouped_matmul
from raylm.model.quantization.gguf_blocks import GgufBlocks, from_gguf
from raylm.model.quantization.int8_panels import Int8Panels, pack_int8_experts, pack_int8_panels
from raylm.model.quantization.quant_array import QuantArray, quantize
from tests.gguf_export import random_blocks
from tests.model.test_int8_matmul import _activations, _reference

pytestmark = pytest.mark.skipif(int8_matmul.unavailable_reason() is not None, reason="int8 kernel not built")

EXPERTS, OUTPUTS, K = 5, (2, 20), 256  # gate_up-shaped experts [E, 2, I, D]: 40 outputs, not whole groups of 16
# Empty experts between groups, then first and last ones empty; padding rows after the groups.
# The last: groups of a prompt chunk's size, which AMX tiles take where the CPU has them (16 rows and
# more, 4-bit blocks 32 and more).
ROUTINGS = [[3, 0, 1, 0, 4], [0, 2, 5, 1, 0], [40, 0, 17, 1, 0]]
PADDING = 2
KINDS = ["Q4_0", "Q4_K", "Q6_K", "Q8_0", "MXFP4", "int8"]


@functools.cache
def _experts(kind: str) -> GgufBlocks | QuantArray:
    """``EXPERTS`` different random matrices stacked ``[E, 2, 20, K]`` in ``kind``."""
    shape = (EXPERTS, *OUTPUTS, K)
    if kind == "int8":
        w = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
        return quantize(jnp.asarray(w), "int8")
    gtype = GGMLQuantizationType[kind]
    return from_gguf(random_blocks(gtype, shape, 11), gtype, shape).to_device()


def _expert(w: GgufBlocks | QuantArray, e: int) -> GgufBlocks | QuantArray:
    """Expert ``e``'s matrix as the 2-D ``[N, K]`` the single-matrix kernel and the reference take."""
    if isinstance(w, QuantArray):
        return QuantArray(w.q[e].reshape(-1, K), w.scale[e].reshape(-1))
    return w._map(lambda a: a[e]).flat()


@functools.cache
def _packed(kind: str) -> Int8Panels:
    return pack_int8_experts(_experts(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_a_stack_packs_each_expert_as_its_matrix(kind):
    w, packed = _experts(kind), _packed(kind)
    assert packed.experts == EXPERTS and packed.shape == w.shape
    if kind == "MXFP4":  # its 4-bit codes stay codes, each expert with the codebook: q [E, G, B, 4, 16, 4]
        assert packed.q.shape[3] == 4 and packed.codebook.shape == (EXPERTS, 16)
    for e in range(EXPERTS):
        alone = pack_int8_panels(_expert(w, e))
        for got, want in zip(jax.tree.leaves(packed.expert(e)), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(w.dequantize()))


def test_one_experts_float32_scales_make_every_experts_tables_float32():
    """Tables are float16 only where every expert's are (one layout for the stack): an expert whose
    scale is not a float16 widens all experts' tables, and every expert still dequantizes exactly."""
    host = jax.device_get(_experts("Q4_0"))
    assert np.asarray(pack_int8_experts(host).scale).dtype == np.float16
    scale = np.asarray(host.scale, np.float32).copy()
    scale[2, 1, 3, 0] = 0.1  # not a float16
    mixed = dataclasses.replace(host, scale=scale)
    packed = pack_int8_experts(mixed)
    assert np.asarray(packed.scale).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(mixed.dequantize()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group_sizes", ROUTINGS)
def test_each_row_is_its_expert_alone_and_the_integer_scheme(kind, group_sizes):
    w, packed = _experts(kind), _packed(kind)
    rows = sum(group_sizes)
    x = _activations(rows + PADDING, K)
    got = np.asarray(grouped_matmul(jnp.asarray(x), packed, jnp.asarray(group_sizes, jnp.int32), kernel=True))
    assert got.shape == (rows + PADDING, *OUTPUTS)
    got = got.reshape(rows + PADDING, -1)
    start = 0
    for e, size in enumerate(group_sizes):
        if not size:
            continue
        mine = got[start: start + size]
        np.testing.assert_array_equal(mine, _reference(x[start: start + size], _expert(w, e)))
        for r in range(size):
            alone = int8_matmul.int8_matmul(jnp.asarray(x[start + r: start + r + 1]), packed.expert(e))
            np.testing.assert_array_equal(mine[r], np.asarray(alone)[0])
        start += size
    np.testing.assert_array_equal(got[rows:], 0.0)


def test_bad_operands_are_clear_errors():
    packed = _packed("Q4_0")
    x = jnp.zeros((3, K), jnp.float32)
    with pytest.raises(ValueError, match=r"group_sizes \[5\] for stacked experts \(5, 2, 20, 256\)"):
        int8_matmul.int8_grouped_matmul(x, packed, jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="int8_matmul takes float32 x"):
        int8_matmul.int8_matmul(x, packed)
    with pytest.raises(ValueError, match="not a stack of experts"):
        packed.expert(0).expert(0)
