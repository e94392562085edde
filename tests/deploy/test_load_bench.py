"""benchmarks/load_bench.py on a tiny checkpoint: its figures are there and consistent."""

from __future__ import annotations

from raylm.benchmarks.load_bench import load_once
from raylm.model.loaders.load import load_checkpoint
from raylm.model.quantization.quant_array import weight_bytes
from tests.checkpoints import build_tiny_checkpoint


def test_one_load_reports_its_weights_and_memory(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    figures = load_once(str(path), keep_blocks=True)
    assert figures["weights_gib"] * 2**30 == weight_bytes(load_checkpoint(path, keep_blocks=True)[1])
    assert figures["load_s"] > 0
    assert 0 < figures["peak_anon_gib"] <= figures["peak_rss_gib"]
    assert 0 < figures["rss_gib"] <= figures["peak_rss_gib"]
