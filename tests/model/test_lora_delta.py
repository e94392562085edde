"""The CPU kernel that adds each row's LoRA delta (model/lora_delta.py) against a float64 NumPy
reference with each adapter merged (``B @ A``) and laid out in the fused QKV by hand; a row's
result the same bits alone as in a batch mixing adapters and base rows; bfloat16 slots the
same bits as float32 slots holding their values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.lora_delta import available
from model.lora_weights import LayerLora, LayerSlots

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
    add = jax.jit(lambda w, s, y, x: LayerLora(w, s, kernel=True).add("qkv", y, x))
    got = np.asarray(add(weights, slots, y, x))
    np.testing.assert_allclose(got, _expected(weights, y, x, slots), rtol=1e-5, atol=1e-4)
    assert np.array_equal(got[slots == 0], y[slots == 0])
    for row, slot in enumerate(slots):  # alone: the same bits
        assert np.array_equal(np.asarray(add(weights, slots[row : row + 1], y[row : row + 1], x[row : row + 1]))[0],
                              got[row]), row
    with pytest.raises(Exception, match="outside"):
        np.asarray(add(weights, np.array([4], np.int32), y[:1], x[:1]))


def test_bfloat16_slots_are_widened_exactly():
    """bfloat16 slots give the float32 kernel's bits on the same (rounded) values."""
    rng = np.random.RandomState(1)
    half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), _slots(rng))
    widened = jax.tree.map(lambda w: w.astype(np.float32), half)
    slots = np.array([3, 1, 0, 3, 3, 2], np.int32)
    x = rng.randn(len(slots), 1, D).astype(np.float32)
    y = rng.randn(len(slots), 1, KVH, G + 2, DH).astype(np.float32)
    add = jax.jit(lambda w, s, y, x: LayerLora(w, s, kernel=True).add("qkv", y, x))
    assert np.array_equal(np.asarray(add(half, slots, y, x)), np.asarray(add(widened, slots, y, x)))
