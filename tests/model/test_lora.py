"""LoRA adapters: PEFT's files read and refused where raylm cannot serve them, and the forward
pass with adapters in device slots against HF transformers with each adapter merged into its
weights (``W + scale * B @ A``)."""

from __future__ import annotations

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.forward import forward
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.decoder.lora_slots import LoraBatch, create_lora_weights, pack_lora_weights, slot_values, write_slot
from raylm.model.errors import LoraAdapterError
from raylm.model.loaders.load import load_checkpoint
from raylm.model.loaders.lora_adapter import load_lora_adapter
from raylm.model.runtime.sharding import make_mesh, shard_lora, shard_params
from tests.checkpoints import build_tiny_checkpoint
from tests.lora_adapters import MODULES, lora_key, write_adapter

BLOCK = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("lora") / "base")


def _logits(params, config, lora, tokens, positions, context_lens, cpu_kernels=False, mesh=None):
    """Every token's logits: rows of ``tokens [B, S]``, each row its own blocks."""
    B, S = tokens.shape
    width = -(-int(np.max(positions) + 1) // BLOCK)
    kv = KVCache.create(config, B * width + 1, BLOCK, jnp.float32, mesh or make_mesh(1))
    tables = 1 + np.arange(B * width, dtype=np.int32).reshape(B, width)
    if cpu_kernels:  # one token per row, each reading its own sequence's blocks
        tables = np.repeat(tables[:1], B, axis=0)
    run = jax.jit(forward, static_argnames=("config", "all_logits", "cpu_kernels"))
    logits, _ = run(params, config, tokens, positions, kv, tables, context_lens, all_logits=True,
                    cpu_kernels=cpu_kernels, lora=lora)
    return np.asarray(logits)


def test_rows_with_their_own_adapters_match_merged_hf(base, tmp_path):
    path, hf = base
    config, params = load_checkpoint(path)
    one, merged_one = write_adapter(tmp_path / "one", hf, rank=4, alpha=8, targets=list(MODULES), seed=1)
    two, merged_two = write_adapter(tmp_path / "two", hf, rank=8, alpha=4, targets=["q_proj", "v_proj", "down_proj"],
                                    seed=2, use_rslora=True, layers=[0, 2])
    weights = create_lora_weights(config, 2, 8, jnp.float32)
    for slot, (name, directory) in enumerate([("one", one), ("two", two)], 1):
        adapter = load_lora_adapter(name, directory, config, max_rank=8)
        weights = write_slot(weights, np.int32(slot - 1), slot_values(adapter, config, 8, np.float32))
    ids = np.random.RandomState(0).randint(3, 320, size=40)
    with torch.no_grad():
        expected = {slot: model(torch.tensor([ids.tolist()])).logits[0].numpy()
                    for slot, model in [(0, hf), (1, merged_one), (2, merged_two)]}
    assert np.abs(expected[1] - expected[0]).max() > 1 and np.abs(expected[2] - expected[0]).max() > 1

    # More rows than slots (every slot's A as one matrix, masked), then rows gathering their own;
    # from the slots per layer, and sliced from the packed array.
    for slots, w in itertools.product(([1, 2, 0, 1], [2]), (weights, pack_lora_weights(weights))):
        B = len(slots)
        logits = _logits(params, config, LoraBatch(w, np.array(slots, np.int32)),
                         np.tile(ids, (B, 1)).astype(np.int32), np.tile(np.arange(40, dtype=np.int32), (B, 1)),
                         np.full(B, 40, np.int32))
        for row, slot in enumerate(slots):
            np.testing.assert_allclose(logits[row], expected[slot], atol=1e-4, rtol=1e-4)

    # Tensor parallelism: each A split like its matrix's inputs, each B like its outputs (on CPU
    # conftest forces two devices; a one-GPU machine has one).
    if jax.device_count() >= 2:
        mesh = make_mesh(2)
        sharded = LoraBatch(shard_lora(weights, config, mesh), np.array([2, 0, 1], np.int32))
        logits = _logits(shard_params(params, config, mesh), config, sharded, np.tile(ids, (3, 1)).astype(np.int32),
                         np.tile(np.arange(40, dtype=np.int32), (3, 1)), np.full(3, 40, np.int32), mesh=mesh)
        for row, slot in enumerate([2, 0, 1]):
            np.testing.assert_allclose(logits[row], expected[slot], atol=1e-4, rtol=1e-4)

    # The CPU kernel path (the slots packed in one array, as a CPU replica keeps them): a prompt
    # packed one token per row, every token with adapter two.
    n = 24
    packed = pack_lora_weights(weights)
    with torch.no_grad():
        short = merged_two(torch.tensor([ids[:n].tolist()])).logits[0].numpy()
    logits = _logits(params, config, LoraBatch(packed, np.full(n, 2, np.int32)), ids[:n, None].astype(np.int32),
                     np.arange(n, dtype=np.int32)[:, None], np.arange(1, n + 1, dtype=np.int32), cpu_kernels=True)
    np.testing.assert_allclose(logits[:, 0], short, atol=1e-4, rtol=1e-4)
    # A slot written into the packed array (one adapter's contents packed alike) is that adapter.
    adapter = load_lora_adapter("one", one, config, max_rank=8)
    rewritten = write_slot(packed, np.int32(1), pack_lora_weights(slot_values(adapter, config, 8, np.float32),
                                                                   slot_axis=False))
    logits = _logits(params, config, LoraBatch(rewritten, np.full(n, 2, np.int32)), ids[:n, None].astype(np.int32),
                     np.arange(n, dtype=np.int32)[:, None], np.arange(1, n + 1, dtype=np.int32), cpu_kernels=True)
    np.testing.assert_allclose(logits[:, 0], expected[1][:n], atol=1e-4, rtol=1e-4)

    # bfloat16 slots (``lora_dtype: bfloat16``) hold the adapter rounded to bfloat16 (8 bits of
    # mantissa): the logits stay within 1% of the adapter's own effect on them (measured 0.6%).
    half = create_lora_weights(config, 2, 8, jnp.bfloat16)
    adapter = load_lora_adapter("two", two, config, max_rank=8)
    half = pack_lora_weights(write_slot(half, np.int32(1), slot_values(adapter, config, 8, jnp.bfloat16)))
    logits = _logits(params, config, LoraBatch(half, np.full(n, 2, np.int32)), ids[:n, None].astype(np.int32),
                     np.arange(n, dtype=np.int32)[:, None], np.arange(1, n + 1, dtype=np.int32), cpu_kernels=True)
    effect = np.abs(short - expected[0][:n]).max()
    assert 0 < np.abs(logits[:, 0] - short).max() < 0.01 * effect


def _write(directory, settings: dict, tensors: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def test_unservable_adapters_are_refused_naming_the_problem(base, tmp_path):
    path, _ = base
    config = ModelConfig.from_hf_dir(path)
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    a, b = np.zeros((4, 64), np.float32), np.zeros((64, 4), np.float32)
    tensors = {lora_key(0, "q_proj", "A"): a, lora_key(0, "q_proj", "B"): b}
    _write(tmp_path / "good", good, tensors)
    assert load_lora_adapter("good", tmp_path / "good", config, 4).targets == ["q_proj"]
    cases = {
        "modules_to_save": ({**good, "modules_to_save": ["lm_head"]}, tensors),
        "DoRA": ({**good, "use_dora": True}, tensors),
        "trained biases": ({**good, "bias": "all"}, tensors),
        "rank_pattern": ({**good, "rank_pattern": {"q_proj": 2}}, tensors),
        "['embed_tokens']": ({**good, "target_modules": ["q_proj", "embed_tokens"]}, tensors),
        "lm_head": (good, {**tensors, "base_model.model.lm_head.lora_A.weight": a}),
        "max_lora_rank 2": (good, tensors),
        "expected (4, 64) and (64, 4)": (good, {**tensors, lora_key(0, "q_proj", "B"): np.zeros((32, 4), np.float32)}),
        "lora_A without lora_B": (good, {lora_key(0, "q_proj", "A"): a}),
        "has 3 layers": (good, {lora_key(3, "q_proj", "A"): a, lora_key(3, "q_proj", "B"): b}),
    }
    for i, (problem, (settings, files)) in enumerate(cases.items()):
        _write(tmp_path / str(i), settings, files)
        with pytest.raises(LoraAdapterError, match=re.escape(problem)):
            load_lora_adapter("bad", tmp_path / str(i), config, 2 if problem == "max_lora_rank 2" else 4)
    with pytest.raises(LoraAdapterError, match="adapter_config.json"):
        load_lora_adapter("missing", tmp_path / "nowhere", config, 4)


def test_an_adapter_of_an_expert_mlp_is_refused(tmp_path):
    """An MoE layer has no single gate/up/down matrix for a delta: refused at load, by name."""
    path, _ = build_tiny_checkpoint("mixtral", tmp_path / "moe")
    config = ModelConfig.from_hf_dir(path)
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["up_proj"], "bias": "none"}
    a = np.zeros((4, config.hidden_size), np.float32)
    b = np.zeros((config.intermediate_size, 4), np.float32)
    _write(tmp_path / "a", settings, {lora_key(0, "up_proj", "A"): a, lora_key(0, "up_proj", "B"): b})
    with pytest.raises(LoraAdapterError, match="mixture of experts"):
        load_lora_adapter("a", tmp_path / "a", config, 4)
