"""Experts split over ``ep`` (model/decoder/expert_parallel.py): the ``shard_map``ped expert block
against a naive per-token loop and against one device's grouped kernel (bit for bit: each device
runs that kernel on its own experts and the others contribute exact zeros), with padding tokens,
routings that leave a device idle, 8-bit experts and gpt-oss's biased, clamped experts; and the
program runs the grouped kernel, not XLA's partitioned ragged_dot. (Whole models at EP=2 and 4
against HF: tests/workers/test_expert_parallel_engine.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import raylm.model.kernels.grouped_matmul as grouped_matmul
from raylm.model.config.expert_mlp import ClampedSwiglu
from raylm.model.decoder.moe import Routing, expert_mlps
from raylm.model.quantization.quant_array import quantize
from raylm.model.runtime.sharding import EP_AXIS, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")

E, D, I, T, K = 6, 32, 16, 11, 2


def _experts(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return rng.randn(E, 2, I, D).astype(np.float32) * 0.3, rng.randn(E, D, I).astype(np.float32) * 0.3


def _naive(h: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``sum_k weight * down(silu(gate h) * up h)`` token by token, in float64."""
    out = np.zeros(h.shape, np.float64)
    for t, x in enumerate(h.astype(np.float64)):
        for e, w in zip(experts[t], weights[t]):
            g, u = gate_up[e, 0] @ x, gate_up[e, 1] @ x
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _split(a):
    return jax.device_put(a, NamedSharding(make_mesh(ep=2), PartitionSpec(EP_AXIS)))


def _routing(experts: np.ndarray, seed: int = 1) -> Routing:
    weights = np.random.RandomState(seed).rand(*experts.shape).astype(np.float32)
    return Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(weights))


def _both(h, routing, gate_up, down, valid=None, biases=None, **options):
    """(one device's result by the grouped kernel, the result with experts split over 2 devices)."""
    run = jax.jit(lambda h, r, g, d, v, b: expert_mlps(h, r, g, d, "silu", kernel=True, valid=v, **(b or {}),
                                                       **options))
    split_biases = None if biases is None else {k: _split(v) for k, v in biases.items()}
    return (np.asarray(run(h, routing, gate_up, down, valid, biases)),
            np.asarray(run(h, routing, _split(gate_up), _split(down), valid, split_biases)))


@pytest.mark.parametrize("layout", ["random", "device-0-only", "device-1-only"])
def test_split_experts_equal_one_device_and_naive(layout):
    """Every token to random experts, or all to the first (second) device's experts: the other
    device computes nothing and adds zeros. Padding tokens (``valid`` False) come out zero."""
    gate_up, down = _experts()
    rng = np.random.RandomState(2)
    h = rng.randn(T, D).astype(np.float32)
    picks = {"random": np.stack([rng.choice(E, K, replace=False) for _ in range(T)]),
             "device-0-only": np.tile([2, 0], (T, 1)), "device-1-only": np.tile([3, 5], (T, 1))}[layout]
    routing = _routing(picks)
    valid = np.arange(T) < T - 3
    one, split = _both(jnp.asarray(h), routing, jnp.asarray(gate_up), jnp.asarray(down), jnp.asarray(valid))
    np.testing.assert_array_equal(split, one)
    reference = _naive(h[valid], picks[valid], np.asarray(routing.weights)[valid], gate_up, down)
    np.testing.assert_allclose(split[valid], reference, atol=1e-5, rtol=1e-5)
    assert not split[~valid].any()


def test_split_int8_and_biased_clamped_experts_equal_one_device():
    """8-bit experts (values and per-channel scales split together) and gpt-oss's per-expert
    biases with its clamped SwiGLU and Llama 4's input-scaling weights."""
    gate_up, down = _experts(3)
    rng = np.random.RandomState(4)
    h = jnp.asarray(rng.randn(T, D).astype(np.float32))
    routing = _routing(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), seed=5)
    one, split = _both(h, routing, quantize(jnp.asarray(gate_up), "int8"), quantize(jnp.asarray(down), "int8"))
    np.testing.assert_array_equal(split, one)
    biases = dict(b_gate_up=jnp.asarray(rng.randn(E, 2, I).astype(np.float32)),
                  b_down=jnp.asarray(rng.randn(E, D).astype(np.float32)))
    one, split = _both(h, routing, jnp.asarray(gate_up), jnp.asarray(down), biases=biases,
                       swiglu=ClampedSwiglu(limit=1.5), weights_scale_input=True)
    np.testing.assert_array_equal(split, one)


@pytest.mark.skipif(not grouped_matmul.available(), reason="the C++ grouped kernel is not built")
def test_split_program_runs_the_grouped_kernel_per_device():
    """XLA's partitioner is never asked to split a ragged_dot: each device calls the kernel."""
    gate_up, down = _experts()
    h = jnp.zeros((T, D), jnp.float32)
    routing = _routing(np.zeros((T, K), np.int64))
    run = jax.jit(lambda h, r, g, d: expert_mlps(h, r, g, d, "silu"))  # kernel=False: a sharded program's flag
    text = run.lower(h, routing, _split(jnp.asarray(gate_up)), _split(jnp.asarray(down))).as_text()
    assert text.count("raylm_grouped_matmul") == 2 and "ragged" not in text
