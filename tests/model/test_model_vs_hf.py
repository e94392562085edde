"""Our JAX forward pass against HF transformers (torch, float32) on identical weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from raylm.model.decoder.generate import SingleSequenceGenerator, _prompt_step
from raylm.model.loaders.load import load_checkpoint
from tests.checkpoints import TINY_VARIANTS, build_tiny_checkpoint
from tests.reference import hf_greedy

PROMPT_LEN = 45  # crosses two 16-token KV blocks and pads the prefill bucket


def _prompt(seed: int = 0, length: int = PROMPT_LEN) -> list[int]:
    return np.random.RandomState(seed).randint(3, 320, size=length).tolist()


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_and_greedy_match_hf(variant, tmp_path):
    path, hf_model = build_tiny_checkpoint(variant, tmp_path / variant)
    config, params = load_checkpoint(path)
    generator = SingleSequenceGenerator(config, params)
    ids = _prompt()

    ours = generator.prompt_logits(ids)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)

    assert list(generator.generate(ids, 32)) == hf_greedy(hf_model, ids, 32)


@pytest.mark.parametrize("variant,dtype", [("llama-gqa", "float32"), ("qwen3-moe", "float32"), ("glm4-moe", "float32"),
                                           ("deepseek-v3", "float32"), ("llama-gqa", "bfloat16")])
def test_float32_matmuls_are_lowered_at_full_precision(variant, dtype, tmp_path):
    """The CPU computes float32 dots in float32 whatever they ask; a GPU rounds them to TF32
    unless the program says HIGHEST (an H200 gave logits ~1e-2 from the test above's HF ones).
    Every dot of a float32 model's forward pass, attention (latent attention's too) and experts
    included, must say so;
    a bfloat16 model's keep JAX's default."""
    path, _ = build_tiny_checkpoint(variant, tmp_path / variant)
    config, params = load_checkpoint(path, dtype)
    generator = SingleSequenceGenerator(config, params)
    tokens, positions = generator._padded_prompt(_prompt(length=5))
    program = _prompt_step.lower(generator.params, generator._new_kv(2), tokens, positions,
                                 jnp.arange(1, 2, dtype=jnp.int32)[None], jnp.array([5], jnp.int32),
                                 config=config, all_logits=True).as_text()
    dots = [line for line in program.splitlines() if "dot_general" in line]
    highest = ["precision = [HIGHEST, HIGHEST]" in line for line in dots]
    assert dots and (all(highest) if dtype == "float32" else not any(highest)), dots[:3]


def test_config_fields_follow_checkpoint(tmp_path):
    path, _ = build_tiny_checkpoint("mistral", tmp_path / "m")
    config, params = load_checkpoint(path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    # 3 layers; QKV fused per KV head: 2 KV heads x (2 query heads + key + value) x head_dim 32,
    # each output's 64 inputs last.
    assert len(params.layers) == 3 and params.layers[0].wqkv.shape == (2, 4, 32, 64)
    path, _ = build_tiny_checkpoint("qwen2", tmp_path / "q")
    config, params = load_checkpoint(path)
    assert config.attention_bias and config.tie_word_embeddings and params.lm_head is None
    assert params.layers[0].bqkv.shape == (2, 4, 16)


def test_sharded_safetensors_load_like_single_file(tmp_path):
    path, hf_model = build_tiny_checkpoint("llama-gqa", tmp_path / "single")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / extra).write_bytes((path / extra).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _, single = load_checkpoint(path)
    _, multi = load_checkpoint(sharded)
    for a, b in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(multi)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_tracks_float32(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    ids = _prompt(1)
    f32 = SingleSequenceGenerator(*load_checkpoint(path, "float32")).prompt_logits(ids)
    bf16 = SingleSequenceGenerator(*load_checkpoint(path, "bfloat16")).prompt_logits(ids)
    assert bf16.dtype == np.float32
    # bfloat16 keeps ~3 significant digits; the logits must agree to that precision.
    assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()
