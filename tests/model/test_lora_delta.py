"""The CPU kernel that adds each row's LoRA delta (model/kernels/lora_delta.py) against a float64 NumPy
reference with each adapter merged (``B @ A``) and laid out in the fused QKV by hand; a row's
result the same bits alone as in a batch mixing adapters and base rows; bfloat16 slots the
same bits as float32 slots holding their values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.decoder.lora_slots import LayerLora, LayerSlots, pack_lora_weights
from raylm.model.kernels.lora_delta import available

pytestmark = pytest.mark.skipif(not available(), reason="the C++ LoRA kernel is not built")

KVH, G, DH, D, N_SLOTS, RANK = 2, 3, 12, 40, 3, 12


def _slots(rng: np.random.RandomState) -> LayerSlots:
    """q/k/v adapters in ``N_SLOTS`` buffers (D = 40, R = 12, q 72 and k/v 24 outputs: every vector tail)."""
    b = {"q_proj": rng.randn(N_SLOTS, RANK, KVH, G, DH), "k_proj": rng.randn(N_SLOTS, RANK, KVH, DH),
         "v_proj": rng.randn(N_SLOTS, RANK, KVH, DH)}
    return LayerSlots({"qkv": rng.randn(N_SLOTS, 3 * RANK, D).astype(np.float32)},
                      {t: v.astype(np.float32) for t, v in b.items()})


def _expected(weights: LayerSlots, y: np.ndarray, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``y`` plus each row's ``x (B A)^T`` per target, q/k/v placed per KV head as the fused QKV."""
    out = y.astype(np.float64)
    a = weights.a["qkv"].astype(np.float64)
    for row, slot in enumerate(slots):
        if slot == 0:
            continue
        deltas = []
        for j, target in enumerate(("q_proj", "k_proj", "v_proj")):
            b = weights.b[target][slot - 1].astype(np.float64)
            merged = b.reshape(RANK, -1).T @ a[slot - 1, j * RANK : (j + 1) * RANK]  # [out, D]
            deltas.append((merged @ x[row, 0]).reshape(KVH, -1, DH))
        out[row, 0] += np.concatenate(deltas, axis=1)  # [KVH, G + 2, DH]
    return out


def test_each_row_gets_its_adapters_delta_alone_or_in_any_batch():
    rng = np.random.RandomState(0)
    weights = _slots(rng)
    slots = np.array([2, 0, 1, 3, 3, 2, 0, 2, 2, 2], np.int32)  # more rows than slots, base rows among them
    x = rng.randn(len(slots), 1, D).astype(np.float32)
    y = rng.randn(len(slots), 1, KVH, G + 2, DH).astype(np.float32)
    add = jax.jit(lambda w, s, y, x: LayerLora(w[0], s, kernel=True).add("qkv", y, x))
    got = np.asarray(add(pack_lora_weights((weights,)), slots, y, x))
    np.testing.assert_allclose(got, _expected(weights, y, x, slots), rtol=1e-5, atol=1e-4)
    assert np.array_equal(got[slots == 0], y[slots == 0])
    for row, slot in enumerate(slots):  # alone: the same bits
        assert np.array_equal(np.asarray(add(pack_lora_weights((weights,)), slots[row : row + 1], y[row : row + 1],
                                             x[row : row + 1]))[0], got[row]), row
    with pytest.raises(Exception, match="outside"):  # the kernel's check: XLA's form would clamp the index
        np.asarray(add(pack_lora_weights((weights,)), np.array([4], np.int32), y[:1], x[:1]))


def test_bfloat16_slots_are_widened_exactly():
    """bfloat16 slots give the float32 kernel's bits on the same (rounded) values."""
    rng = np.random.RandomState(1)
    half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), _slots(rng))
    widened = jax.tree.map(lambda w: w.astype(np.float32), half)
    slots = np.array([3, 1, 0, 3, 3, 2], np.int32)
    x = rng.randn(len(slots), 1, D).astype(np.float32)
    y = rng.randn(len(slots), 1, KVH, G + 2, DH).astype(np.float32)
    add = jax.jit(lambda w, s, y, x: LayerLora(w[0], s, kernel=True).add("qkv", y, x))
    assert np.array_equal(np.asarray(add(pack_lora_weights((half,)), slots, y, x)),
                          np.asarray(add(pack_lora_weights((widened,)), slots, y, x)))


def test_int8_slots_add_their_dequantized_deltas_the_same_alone_or_batched():
    """int8 slots (``engine.lora_dtype: int8``): each ``A`` row and ``B`` output quantized with its
    own scale; the kernel adds the deltas of the dequantized values (float64 reference), a row's
    the same bits alone, and they stay within 2% of the float adapter's deltas."""
    rng = np.random.RandomState(2)
    weights = _slots(rng)
    packed = pack_lora_weights((weights,), dtype=jnp.int8)
    assert packed.buffer.dtype == np.int8 and packed.scales.dtype == np.float32
    dequantized = jax.tree.map(np.asarray, packed[0].unpacked())
    slots = np.array([1, 3, 0, 2, 3, 3, 1], np.int32)
    x = rng.randn(len(slots), 1, D).astype(np.float32)
    y = rng.randn(len(slots), 1, KVH, G + 2, DH).astype(np.float32)
    add = jax.jit(lambda w, s, y, x: LayerLora(w[0], s, kernel=True).add("qkv", y, x))
    got = np.asarray(add(packed, slots, y, x))
    np.testing.assert_allclose(got, _expected(dequantized, y, x, slots), rtol=1e-5, atol=1e-4)
    for row in range(len(slots)):
        assert np.array_equal(np.asarray(add(packed, slots[row : row + 1], y[row : row + 1], x[row : row + 1]))[0],
                              got[row]), row
    exact = _expected(weights, y, x, slots) - y
    assert np.abs((got - y) - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("dtype", [None, jnp.int8], ids=["float32", "int8"])
def test_a_lone_rows_split_call_sums_as_a_batchs_call_of_one_item_per_adapter(dtype):
    """A call of one (adapter, target) pair, one row's down_proj, splits each phase over items of
    columns; a call of several gives each pair one item running both phases (lora_delta.cc's
    kFusedMinPairs). Shapes where the split call cuts several items in each phase (K 1100: 16
    rows of A an item; R 40: 448 outputs an item): a row's delta is the same bits either way,
    and the float64 reference's."""
    rng = np.random.RandomState(3)
    K, R, O = 1100, 40, 600
    weights = LayerSlots({"down_proj": (rng.randn(N_SLOTS, R, K) * 0.05).astype(np.float32)},
                         {"down_proj": (rng.randn(N_SLOTS, R, O) * 0.05).astype(np.float32)})
    packed = pack_lora_weights((weights,), dtype=dtype)
    merged = jax.tree.map(np.asarray, packed[0].unpacked())
    slots = np.array([1, 2, 3, 0, 2], np.int32)
    x = rng.randn(len(slots), 1, K).astype(np.float32)
    y = rng.randn(len(slots), 1, O).astype(np.float32)
    add = jax.jit(lambda w, s, y, x: LayerLora(w[0], s, kernel=True).add("down_proj", y, x))
    got = np.asarray(add(packed, slots, y, x))
    expected = y.astype(np.float64)
    for row, slot in enumerate(slots):
        if slot:
            a, b = (np.asarray(merged.a["down_proj"][slot - 1], np.float64),
                    np.asarray(merged.b["down_proj"][slot - 1], np.float64))
            expected[row, 0] += (x[row, 0] @ a.T) @ b
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    for row in range(len(slots)):
        assert np.array_equal(np.asarray(add(packed, slots[row : row + 1], y[row : row + 1], x[row : row + 1]))[0],
                              got[row]), row
