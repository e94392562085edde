"""TP=2 (and EP=2) over two forced host devices gives the logits and tokens of one device; EP=2 x
TP=2 over four (in a child process: the suite's has two)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.load import load_checkpoint
from raylm.model.runtime.sharding import make_mesh, rules_for
from tests.checkpoints import build_tiny_checkpoint
from tests.reruns import rerun_in_child

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")


@pytest.mark.parametrize(
    "variant,overrides",
    [
        ("llama-gqa", {}),  # 4 heads / 2 KV heads: both split
        ("qwen2", {}),  # biases split with their heads
        ("llama-gqa", {"num_key_value_heads": 1}),  # 1 KV head: replicated, query heads split
    ],
)
def test_tp2_equals_tp1(tmp_path, variant, overrides):
    path, _ = build_tiny_checkpoint(variant, tmp_path / variant, **overrides)
    config, params = load_checkpoint(path)
    ids = np.random.RandomState(3).randint(3, 320, size=40).tolist()
    tp1 = SingleSequenceGenerator(config, params, mesh=make_mesh(1))
    tp2 = SingleSequenceGenerator(config, params, mesh=make_mesh(2))
    layer = tp2.params.layers[0]
    # Query heads split (through wo's heads axis); fused QKV split by KV head unless KV heads are replicated.
    assert layer.wo.addressable_shards[0].data.shape[1] == config.num_heads // 2
    kv_per_device = config.num_kv_heads // 2 if config.num_kv_heads % 2 == 0 else config.num_kv_heads
    assert layer.wqkv.addressable_shards[0].data.shape[0] == kv_per_device
    assert layer.w_gate_up.addressable_shards[0].data.shape[1] == config.intermediate_size // 2
    np.testing.assert_allclose(tp2.prompt_logits(ids), tp1.prompt_logits(ids), atol=1e-4, rtol=1e-5)
    assert list(tp2.generate(ids, 24)) == list(tp1.generate(ids, 24))


def test_ep2_equals_ep1(tmp_path):
    """Experts split over 2 devices (4 each; layer 1 is dense) give the single-device logits and tokens."""
    path, _ = build_tiny_checkpoint("qwen3-moe", tmp_path / "m")
    config, params = load_checkpoint(path)
    ids = np.random.RandomState(3).randint(3, 320, size=40).tolist()
    ep1 = SingleSequenceGenerator(config, params, mesh=make_mesh(1))
    ep2 = SingleSequenceGenerator(config, params, mesh=make_mesh(ep=2))
    layer = ep2.params.layers[0]
    assert layer.w_experts_gate_up.addressable_shards[0].data.shape[0] == config.moe.num_experts // 2
    assert layer.wqkv.addressable_shards[0].data.shape == layer.wqkv.shape  # attention replicated
    np.testing.assert_allclose(ep2.prompt_logits(ids), ep1.prompt_logits(ids), atol=1e-4, rtol=1e-5)
    assert list(ep2.generate(ids, 24)) == list(ep1.generate(ids, 24))


@pytest.mark.parametrize("variant,tp,ep", [("glm4-moe", 2, 1), ("glm4-moe", 1, 2), ("deepseek-v3", 1, 2)])
def test_deepseek_style_sharded_equals_one_device(tmp_path, variant, tp, ep):
    """GLM-4.5's and DeepSeek-V3's arrays shard as declared: the ungated shared experts' hidden dim
    over ``tp`` (with the dense first layer's MLP), the routed experts over ``ep``, the router and
    its correction bias replicated (every device routes every token). (DeepSeek-V3's TP=2, latent
    attention's heads split: tests/workers/test_model_families_engine.py.)"""
    path, _ = build_tiny_checkpoint(variant, tmp_path / "m")
    config, params = load_checkpoint(path)
    ids = np.random.RandomState(3).randint(3, 320, size=24).tolist()
    one = SingleSequenceGenerator(config, params, mesh=make_mesh(1))
    sharded = SingleSequenceGenerator(config, params, mesh=make_mesh(tp, ep=ep))
    dense, sparse = sharded.params.layers[0], sharded.params.layers[1]
    assert dense.w_gate_up.addressable_shards[0].data.shape[1] == config.intermediate_size // tp
    assert sparse.w_shared_gate_up.addressable_shards[0].data.shape[1] == config.moe.shared_expert_size // tp
    assert sparse.w_experts_gate_up.addressable_shards[0].data.shape[0] == config.moe.num_experts // ep
    for replicated in (sparse.router, sparse.router_score_bias):
        assert replicated.addressable_shards[0].data.shape == replicated.shape
    assert sparse.router_score_bias.dtype == np.float32
    np.testing.assert_allclose(sharded.prompt_logits(ids), one.prompt_logits(ids), atol=1e-4, rtol=1e-5)
    assert list(sharded.generate(ids, 8)) == list(one.generate(ids, 8))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: test_ep2_tp2_on_four_devices runs it")
def test_ep2_tp2_equals_one_device(tmp_path):
    """Experts split over ``ep``, attention heads and the dense layer's MLP over ``tp``, at once."""
    path, _ = build_tiny_checkpoint("qwen3-moe", tmp_path / "m")
    config, params = load_checkpoint(path)
    ids = np.random.RandomState(3).randint(3, 320, size=24).tolist()
    one = SingleSequenceGenerator(config, params, mesh=make_mesh(1))
    both = SingleSequenceGenerator(config, params, mesh=make_mesh(2, ep=2))
    sparse, dense = both.params.layers[0], both.params.layers[1]
    assert sparse.w_experts_gate_up.addressable_shards[0].data.shape[0] == config.moe.num_experts // 2
    assert sparse.wo.addressable_shards[0].data.shape[1] == config.num_heads // 2
    assert dense.w_gate_up.addressable_shards[0].data.shape[1] == config.intermediate_size // 2
    np.testing.assert_allclose(both.prompt_logits(ids), one.prompt_logits(ids), atol=1e-4, rtol=1e-5)
    assert list(both.generate(ids, 8)) == list(one.generate(ids, 8))


def test_ep2_tp2_on_four_devices():
    """The test above in a child process with four forced host devices."""
    rerun_in_child(__file__, "test_ep2_tp2_equals_one_device", {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                   expected="1 passed")


def test_ep_must_divide_experts(tmp_path):
    path, _ = build_tiny_checkpoint("mixtral", tmp_path / "m")
    config, _ = load_checkpoint(path)
    with pytest.raises(UnsupportedModelError, match="does not divide the expert count 4"):
        rules_for(config, 1, ep=3)
    dense, _ = load_checkpoint(build_tiny_checkpoint("llama-gqa", tmp_path / "d")[0])
    with pytest.raises(UnsupportedModelError, match="has no experts"):
        rules_for(dense, 1, ep=2)


def test_kv_heads_replicated_when_tp_exceeds_them(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m", num_key_value_heads=1)
    config, _ = load_checkpoint(path)
    assert rules_for(config, 2)["kv_heads"] is None and rules_for(config, 2)["heads"] == "tp"


def test_tp_must_divide_heads(bundled_model):
    with pytest.raises(UnsupportedModelError, match=r"does not divide num_attention_heads=9; choose tp from \[1, 3, 9\]"):
        rules_for(bundled_model.config, 2)


def test_tp_larger_than_devices():
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(64)


def _bytes_on(device: jax.Device) -> int:
    """Bytes of the live buffers on ``device`` (each once: ``live_arrays`` lists a sharded array's
    shards as arrays of their own too)."""
    buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes
               for a in jax.live_arrays() for s in a.addressable_shards if s.device == device}
    return sum(buffers.values())


def test_a_mesh_given_at_load_places_each_layer_as_it_is_built(tmp_path, monkeypatch):
    """Loaded with the replica's mesh, every layer goes to its shards as soon as it is built: the
    first device never holds more than its half of the layers built so far plus one whole layer
    (placed after loading, it held the whole model first), and the placed parameters are exactly
    ``shard_params`` of the unplaced ones: the same shardings, the same values."""
    from raylm.model.runtime import sharding
    from raylm.model.runtime.sharding import ParamPlacer, shard_params

    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m", num_hidden_layers=8)
    mesh = make_mesh(2)
    first = mesh.devices.flat[0]
    config, unplaced = load_checkpoint(path)
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(unplaced.layers[0]))
    whole_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(unplaced))
    expected = shard_params(unplaced, config, mesh)
    del unplaced

    on_first: list[int] = []
    place_layer = ParamPlacer.layer

    def recording(self, lp):
        on_first.append(_bytes_on(first))  # the layers before (placed) and this one (whole)
        return place_layer(self, lp)

    monkeypatch.setattr(sharding.ParamPlacer, "layer", recording)
    baseline = _bytes_on(first)
    _, placed = load_checkpoint(path, mesh=mesh)
    assert len(on_first) == config.num_layers
    peak = max(on_first) - baseline
    # (the embedding and head: replicated on both devices, ~a layer's bytes each here)
    assert peak <= whole_bytes / 2 + 3 * layer_bytes, (peak, whole_bytes, layer_bytes)
    assert peak < 0.8 * whole_bytes
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(expected)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
