"""The KV offload benchmark end to end on a tiny checkpoint, on the session's Ray cluster: every
part runs, its counts match what the workload implies (hand-computed from the sizes asked for),
outputs are the same with and without a tier, and the table prints. Not its timings."""

from __future__ import annotations

import json
import math

from raylm.benchmarks.kv_offload import main
from raylm.model.loaders.load import load_model
from tests.checkpoints import build_tiny_checkpoint

PREFIX = 96  # 6 blocks of 16
REQUESTS, CONVERSATIONS, TURNS, ANSWER, TRANSFER_BLOCKS = 3, 3, 2, 8, 4


def test_every_part_runs_on_a_tiny_checkpoint(tmp_path, serve_cluster, capsys):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    config = load_model(path).config
    results = main([
        "--model", str(path), "--prefix-tokens", str(PREFIX), "--requests", str(REQUESTS), "--num-kv-blocks", "64",
        "--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--system-tokens", "32", "--doc-tokens", "48",
        "--answer-tokens", str(ANSWER), "--transfer-blocks", str(TRANSFER_BLOCKS), "--tier-bytes", str(64 << 20),
        "--no-warmup",
    ])
    cluster, chats, restart, transfer = results
    printed = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["part"] for line in printed[:4]] == ["cluster", "conversations", "restart", "transfer"]
    assert any(line.startswith("cross-replica prefix") for line in printed[4:])

    # A published both prefixes (the warm-up's and the timed one's); B loaded the timed prefix at
    # least once and computed fewer prompt tokens than the engine without a tier.
    assert cluster["same_tokens"] and cluster["prefix_tokens"] == PREFIX and not cluster["errors"]
    assert cluster["published_blocks"] >= 2 * PREFIX // 16
    assert cluster["loaded_tokens"] >= PREFIX and cluster["cluster_hits"] >= 2 * PREFIX // 16
    assert cluster["prompt_tokens"]["with"] < cluster["prompt_tokens"]["without"]
    assert all(0 < cluster[k] < math.inf for k in ("ttft_ratio_mean", "ttft_ratio_p50"))

    # Every chat answered every turn in full; the pool is the chats' context over 4 (or holds the longest).
    assert chats["same_tokens"]
    for run in (chats["with"], chats["without"]):
        assert run["output_tokens"] == CONVERSATIONS * TURNS * ANSWER
    assert chats["live_over_pool"] <= 4.0 + 1e-9 and chats["with"]["loaded_tokens"] > 0
    assert chats["prompt_tokens_ratio"] < 1 and chats["with"]["prompt_tokens"] < chats["without"]["prompt_tokens"]

    # The restarted engine read the warm-up's and the prefix's blocks from the files the first wrote.
    assert restart["same_tokens"] and not restart["errors"]
    assert restart["stored_blocks"] >= 2 * PREFIX // 16 and restart["disk_hits"] >= 2 * PREFIX // 16
    assert restart["ttft_ratio"] > 0

    # One block: K and V of every layer, 16 tokens x KV heads x head size float32 values each.
    block = config.num_layers * 2 * 16 * config.num_kv_heads * config.head_dim * 4
    assert transfer["block_bytes"] == block and transfer["bytes"] == TRANSFER_BLOCKS * block
    assert transfer["equal"] and not transfer["errors"] and transfer["get_gb_s"] > 0
