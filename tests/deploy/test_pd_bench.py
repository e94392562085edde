"""The disaggregation benchmark: its latency arithmetic on hand-computed streams, and a smoke run of
the script on a tiny model (both deployments served on the session's Ray cluster) that checks it
runs and reports sane fields, not its timings."""

from __future__ import annotations

import pytest

from raylm.benchmarks import pd_bench
from raylm.benchmarks.pd_traffic import LongPromptRecord, StreamRecord, summarize, token_gaps
from tests.checkpoints import build_tiny_checkpoint


def test_token_gaps_count_the_window_s_tokens_and_split_multi_token_chunks():
    # chunks at 1.0, 1.1, 1.4 (2 tokens), 2.0; the window [1.05, 1.5] holds the chunks at 1.1 and 1.4
    record = StreamRecord(times=[1.0, 1.1, 1.4, 2.0], tokens=[1, 1, 2, 1])
    assert token_gaps(record, 1.05, 1.5) == pytest.approx([0.1, 0.15, 0.15])
    assert token_gaps(record, 0.0, 9.0) == pytest.approx([0.1, 0.15, 0.15, 0.6])


def test_summary_percentiles_and_long_prompts():
    streams = [StreamRecord(times=[0.0, 0.1, 0.2, 0.3], tokens=[1, 1, 1, 1]),
               StreamRecord(times=[0.0, 0.5], tokens=[1, 1], finished=True)]
    longs = [LongPromptRecord(sent=0.0, ttft_s=0.4, cached_tokens=64), LongPromptRecord(sent=0.1, ttft_s=0.8,
                                                                                        cached_tokens=0),
             LongPromptRecord(sent=0.2, error="HTTP 503")]
    summary = summarize(streams, longs, 0.0, 1.0)
    # gaps 0.1, 0.1, 0.1, 0.5: the median 0.1, the 99th percentile 0.1 + 0.97 * (0.5 - 0.1)
    assert summary["decode_tokens"] == 4 and summary["decode_tok_s"] == pytest.approx(4.0)
    assert summary["tpot_ms_p50"] == pytest.approx(100.0)
    assert summary["tpot_ms_p99"] == pytest.approx(100.0 + 0.97 * 400.0)
    assert summary["streams_ended_early"] == 1
    assert (summary["long_prompts_sent"], summary["long_prompts_completed"]) == (3, 2)
    assert summary["long_ttft_ms_p50"] == pytest.approx(600.0)
    assert summary["long_cached_tokens_mean"] == pytest.approx(32.0)
    assert summary["long_prompt_errors"] == ["HTTP 503"]


def test_ratios_are_disaggregated_over_colocated():
    a = {"tpot_ms_p50": 50.0, "tpot_ms_p99": 400.0, "long_ttft_ms_p50": 1000.0, "long_ttft_ms_p99": None}
    b = {"tpot_ms_p50": 60.0, "tpot_ms_p99": 100.0, "long_ttft_ms_p50": 500.0, "long_ttft_ms_p99": 900.0}
    assert pd_bench.ratios(a, b) == {"tpot_ms_p50": pytest.approx(1.2), "tpot_ms_p99": pytest.approx(0.25),
                                     "long_ttft_ms_p50": pytest.approx(0.5), "long_ttft_ms_p99": None}


def test_smoke_run_on_a_tiny_model(serve_cluster, tmp_path, capsys):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m", max_position_embeddings=1024)
    args = pd_bench.build_parser().parse_args(["--smoke", "--model", str(path), "--json", str(tmp_path / "pd.json")])
    rows = pd_bench.run(f"http://127.0.0.1:{serve_cluster.http_port}", args)
    out = capsys.readouterr().out
    smoke = pd_bench.SMOKE
    for name, row in rows.items():
        assert row["stream_errors"] == [] and row["long_prompt_errors"] == [], row
        assert row["streams"] == smoke.streams and row["streams_ended_early"] == 0, row
        assert row["long_prompts_sent"] == row["long_prompts_completed"] == 4, row  # at 0, 0.5, 1, 1.5 s
        assert row["decode_tokens"] > 0 and 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"] <= row["tpot_ms_max"], row
        assert 0 < row["long_ttft_ms_p50"] <= row["long_ttft_ms_p99"], row
        assert sum(row["requests_per_replica"]) >= smoke.streams + 4, row  # the prefill hop counts there too
        computed = row["step_rates"]["kinds"]
        assert sum(k["tokens"] for k in computed.values()) >= 4 * smoke.long_prompt_tokens // 2, row
        assert len(row["pinned"]) == 2 and {p.split("-> core ")[1].split()[0] for p in row["pinned"]} == {"0", "1"}, row
    # every stream went to one replica; in the disaggregated deployment through both (prefill, then decode)
    assert sum(rows["colocated"]["streams_per_replica"]) == smoke.streams
    assert rows["disaggregated"]["streams_per_replica"] == [smoke.streams, smoke.streams]
    # the decode replica never computed a long prompt's full blocks: the prefill replica handed them over
    assert rows["disaggregated"]["long_cached_tokens_mean"] == (smoke.long_prompt_tokens - 1) // 16 * 16
    assert rows["colocated"]["long_cached_tokens_mean"] == 0
    report = out.split("== ")[-1]
    assert "decode TPOT p99 (ms)" in report and "B/A" in report and (tmp_path / "pd.json").exists()
