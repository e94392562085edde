"""The pipeline benchmark: its arithmetic on hand-computed cases, and a smoke run of the script on a
tiny model (its own two-node Ray cluster, in a subprocess) that checks it runs and reports sane
fields, not its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.benchmarks import pipeline_bench
from tests.checkpoints import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_bubbles_tpot_and_ratios():
    assert pipeline_bench.bubble_fractions([3.0, 1.5], 4.0) == pytest.approx([0.25, 0.625])
    # 10 tokens in 2.0 s, the first alone in 0.2 s: 9 more tokens in 1.8 s
    assert pipeline_bench.time_per_output_token(2.0, 0.2, 10) == pytest.approx(0.2)
    pp1 = {"rss_bytes": [1000], "held_bytes": [800], "tok_s": {"16": 50.0}, "tpot_s": 0.1}
    pp2 = {"rss_bytes": [500, 600], "held_bytes": [420, 400], "tok_s": {"16": 45.0}, "tpot_s": 0.12}
    assert pipeline_bench.ratios(pp1, pp2) == pytest.approx(
        {"memory_per_node": 0.6, "held_bytes_per_node": 0.525, "tok_s_16": 0.9, "tpot": 1.2})
    assert pipeline_bench.meets("memory_per_node", 0.6) and not pipeline_bench.meets("memory_per_node", 0.61)
    assert pipeline_bench.meets("tok_s_16", 0.8) and not pipeline_bench.meets("tok_s_16", 0.79)


def test_served_weight_bytes_scale_the_stored_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 50)
    assert pipeline_bench.served_weight_bytes(tmp_path, "float32") == 150  # kept as stored
    assert pipeline_bench.served_weight_bytes(tmp_path, "bfloat16") == 150
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert pipeline_bench.served_weight_bytes(tmp_path, "bfloat16") == 75


def test_smoke_run_on_a_tiny_model(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")  # 3 layers, hidden 64, float32
    out = tmp_path / "pp.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one host device a process, as run by hand
    proc = subprocess.run([sys.executable, "-m", "raylm.benchmarks.pipeline_bench", "--smoke", "--model", str(path),
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    pp1, pp2 = report["pp1"], report["pp2"]

    # One process on both cores (XLA's pool of two threads) against two stages, on two nodes, a
    # core (and a pool thread) each.
    assert len(pp1["stages"]) == 1 and pp1["pinned"][0].endswith("XLA pool 2) -> cores [0, 1]"), pp1["pinned"]
    assert len({s["node_id"] for s in pp2["stages"]}) == 2 and len({s["pid"] for s in pp2["stages"]}) == 2
    assert [p.split("XLA pool ")[1] for p in pp2["pinned"]] == ["1) -> cores [0]", "1) -> cores [1]"], pp2["pinned"]
    assert report["same_tokens"]

    # The stages hold the layers' weights and KV of the whole between them (each stage its own
    # copy of the final norm: 64 float32).
    assert sum(h["weight_bytes"] for h in pp2["held"]) == pp1["held"][0]["weight_bytes"] + 64 * 4
    assert sum(h["kv_bytes"] for h in pp2["held"]) == pp1["held"][0]["kv_bytes"]

    # Reserving the whole model's memory on one node is infeasible; each stage's bundle was placed.
    reservation = report["pp1_whole_model_reservation"]
    assert reservation["scheduling_state"] == "INFEASIBLE" and not reservation["placed"]
    assert report["node_memory_bytes"] < reservation["requested_memory_bytes"]

    smoke = pipeline_bench.SMOKE
    for layout, stages in ((pp1, 0), (pp2, 2)):
        assert set(layout["tok_s"]) == {str(n) for n in smoke.levels} and min(layout["tok_s"].values()) > 0
        assert isinstance(layout["tpot_s"], float) and min(layout["rss_bytes"]) > 0  # (a difference: noise here)
        assert all(len(b) == stages and all(0 <= f < 1 for f in b) for b in layout["bubble"].values())
    assert len(report["transfer_ms"]) == 2 and min(report["transfer_ms"].values()) > 0
    assert set(report["ratios"]) == {"memory_per_node", "held_bytes_per_node", "tok_s_16", "tpot"}
    assert "pp2 / pp1 tok_s_16" in proc.stdout
