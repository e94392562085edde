"""The expert-parallel benchmark serves a tiny MoE at EP=1 and EP=2 (the suite's two forced host
devices) through its measured passes: every round of both replicas delivers output tokens."""

from __future__ import annotations

import jax
import pytest

from raylm.benchmarks.ep_bench import serve_rates
from tests.checkpoints import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")


def test_both_replicas_serve_every_round(tmp_path):
    path, _ = build_tiny_checkpoint("qwen3-moe", tmp_path / "m")
    rates = serve_rates(path, 2, streams=2, requests=3, prompt_len=5, output_len=3, rounds=2)
    assert sorted(rates) == [1, 2]
    assert all(len(r) == 2 and min(r) > 0 for r in rates.values())
