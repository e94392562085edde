"""The operations counted per forward pass (model/decoder/flop_count.py), against hand computations and
the HF model's own weights."""

from __future__ import annotations

import dataclasses

import numpy as np

from raylm.model.decoder.flop_count import ModelFlops
from raylm.model.loaders.load import load_model
from tests.checkpoints import build_tiny_checkpoint


def test_a_tiny_llama_counts_as_by_hand(tmp_path):
    """llama-gqa: hidden 64, ffn 128, 3 layers, 4 heads / 2 KV heads of 16, vocab 320, untied."""
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    flops = ModelFlops.of(*_config_params(path))
    # Per layer q 64x64 + k, v 32x64 each + o 64x64 + gate, up 128x64 each + down 64x128.
    per_layer = 4096 + 2 * 2048 + 4096 + 3 * 8192
    assert flops.matrix_params == 3 * per_layer == 110_592
    assert flops.head_params == 320 * 64
    assert flops.attention == ((None, 3 * 4 * 4 * 16),)
    # A 4-token prompt chunk from position 0 (its tokens read 1, 2, 3, 4 keys) with its last
    # token's logits, and a decode token at position 9 (10 keys) with its own.
    chunk = 2 * (110_592 * 4 + 20_480) + 768 * (1 + 2 + 3 + 4)
    decode = 2 * (110_592 + 20_480) + 768 * 10
    assert flops.flops(1, np.array([0]), np.array([4])) == chunk == 933_376
    assert flops.flops(2, np.array([0, 9]), np.array([4, 1])) == chunk + decode
    assert flops.flops(0, np.array([5]), np.array([0])) == 0  # an empty run


def test_weights_per_token_are_the_hf_models_matrices_with_active_experts(tmp_path):
    """qwen2-moe: a dense layer, then 4 experts (top-2) with a router and a gated shared expert."""
    path, hf = build_tiny_checkpoint("qwen2-moe", tmp_path / "m")
    config, params = _config_params(path)
    experts, top_k = hf.config.num_experts, hf.config.num_experts_per_tok
    active = sum(p.numel() * (top_k / experts if ".experts." in name else 1)
                 for name, p in hf.model.layers.named_parameters() if p.ndim >= 2)
    flops = ModelFlops.of(config, params)
    assert flops.matrix_params == active
    assert flops.head_params == hf.lm_head.weight.numel()


def test_sliding_windows_cap_the_keys_each_token_reads():
    """Runs across a 16-key window, against summing ``min(position + 1, window)`` token by token."""
    one_layer = ModelFlops(matrix_params=0, head_params=0, attention=((16, 1), (None, 1000)))
    rng = np.random.default_rng(0)
    starts, counts = rng.integers(0, 40, size=50), rng.integers(0, 30, size=50)
    naive = sum(min(p + 1, 16) + 1000 * (p + 1) for s, n in zip(starts, counts) for p in range(s, s + n))
    assert one_layer.flops(0, starts, counts) == naive
    assert dataclasses.replace(one_layer, attention=((16, 1),)).flops(0, np.array([14]), np.array([4])) == \
        15 + 16 + 16 + 16


def _config_params(path):
    model = load_model(path)
    return model.config, model.params
