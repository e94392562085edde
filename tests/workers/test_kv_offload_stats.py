"""The KV offload tiers' counters as a replica reports them: through Ray as plain data, into the
per-tier metrics (counter increments between snapshots, gauges, read times) and as ``raylm
status`` shows them. Figures are hand-computed from the TierStats built here."""

from __future__ import annotations

from raylm.cache.block_pool import PoolStats
from raylm.cache.offload.tier import RECENT_LOADS, TierStats
from raylm.deploy.status_command import kv_offload_summary
from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.serve.replica_metrics import EngineStatsReporter

POOL = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                 prefix_queries=0, prefix_hits=0)
GiB = 1 << 30


def _stats(tiers: tuple[TierStats, ...] | None, loading: int = 0) -> EngineStats:
    return EngineStats(running=1, waiting=0, waiting_tokens=0, work_tokens=0, tokens_stored=0, token_capacity=0,
                       num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0, pool=POOL,
                       loading=loading, kv_offload=tiers)


class _Recorder:
    """WorkerMetrics' ``inc``, ``set`` and ``observe``: counter totals, last gauge values and
    histogram samples, each keyed by metric name and its extra tags."""

    def __init__(self) -> None:
        self.counters: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}
        self.samples: dict[tuple, list[float]] = {}

    def inc(self, name: str, value: float, **tags: str) -> None:
        if value > 0:  # as WorkerMetrics: a Ray counter takes only positive increments
            key = (name, *sorted(tags.items()))
            self.counters[key] = self.counters.get(key, 0) + value

    def set(self, name: str, value: float, **tags: str) -> None:
        self.gauges[(name, *sorted(tags.items()))] = value

    def observe(self, name: str, value: float, **tags: str) -> None:
        self.samples.setdefault((name, *sorted(tags.items())), []).append(value)


def test_tier_counters_cross_ray_as_plain_data():
    stats = _stats((TierStats("host", 4 * GiB, stored_bytes=GiB, stored_blocks=3, hits=5, misses=1, stored=9,
                              evicted=6, load_bytes=5 * 1024, loads=1, recent_load_seconds=[0.25], errors={"too_large": 1}),),
                   loading=2)
    assert EngineStats.from_dict(stats.as_dict()) == stats
    assert EngineStats.from_dict(_stats(None).as_dict()).kv_offload is None


def test_reporter_turns_snapshots_into_per_tier_increments_gauges_and_read_times():
    recorder = _Recorder()
    reporter = EngineStatsReporter(recorder)
    host = TierStats("host", 4 * GiB, stored_bytes=GiB, stored_blocks=4, hits=10, misses=2, stored=7, evicted=3,
                     load_bytes=10 * 4096, loads=2, recent_load_seconds=[0.001, 0.002])
    reporter.report(_stats((host,), loading=3))
    # Later: host moved on (one more read); a disk tier reports for the first time (counted from
    # zero), with errors.
    host = TierStats("host", 4 * GiB, stored_bytes=2 * GiB, stored_blocks=8, hits=15, misses=2, stored=12, evicted=3,
                     load_bytes=15 * 4096, loads=3, recent_load_seconds=[0.001, 0.002, 0.004])
    disk = TierStats("disk", 64 * GiB, stored_bytes=GiB // 2, stored_blocks=2, hits=1, misses=1, stored=2,
                     load_bytes=4096, loads=1, recent_load_seconds=[0.05], errors={"corrupt": 2, "write": 0})
    reporter.report(_stats((host, disk), loading=0))
    reporter.report(_stats((host, disk), loading=0))  # another reader's snapshot: nothing new, nothing twice
    host_tag, disk_tag = ("tier", "host"), ("tier", "disk")
    assert recorder.counters == {
        ("raylm_kv_offload_hits_total", host_tag): 15, ("raylm_kv_offload_misses_total", host_tag): 2,
        ("raylm_kv_offload_stored_total", host_tag): 12, ("raylm_kv_offload_evicted_total", host_tag): 3,
        ("raylm_kv_offload_load_bytes_total", host_tag): 15 * 4096,
        ("raylm_kv_offload_hits_total", disk_tag): 1, ("raylm_kv_offload_misses_total", disk_tag): 1,
        ("raylm_kv_offload_stored_total", disk_tag): 2, ("raylm_kv_offload_load_bytes_total", disk_tag): 4096,
        ("raylm_kv_offload_errors_total", ("kind", "corrupt"), disk_tag): 2,
    }
    assert recorder.gauges[("raylm_kv_offload_stored_bytes", host_tag)] == 2 * GiB
    assert recorder.gauges[("raylm_kv_offload_capacity_bytes", host_tag)] == 4 * GiB
    assert recorder.gauges[("raylm_kv_offload_stored_bytes", disk_tag)] == GiB // 2
    assert recorder.gauges[("raylm_kv_offload_capacity_bytes", disk_tag)] == 64 * GiB
    assert recorder.gauges[("raylm_num_requests_loading",)] == 0
    assert recorder.samples[("raylm_kv_offload_load_seconds", host_tag)] == [0.001, 0.002, 0.004]
    assert recorder.samples[("raylm_kv_offload_load_seconds", disk_tag)] == [0.05]


def test_more_reads_between_snapshots_than_a_snapshot_keeps_observe_those_kept():
    recorder = _Recorder()
    reporter = EngineStatsReporter(recorder)
    reporter.report(_stats((TierStats("cluster", GiB, loads=1, recent_load_seconds=[9.0]),)))
    kept = [i / 1000 for i in range(RECENT_LOADS)]  # the newest RECENT_LOADS of 1 + 300 reads
    reporter.report(_stats((TierStats("cluster", GiB, loads=301, recent_load_seconds=kept),)))
    assert recorder.samples[("raylm_kv_offload_load_seconds", ("tier", "cluster"))] == [9.0] + kept


def test_without_offload_only_the_loading_gauge_is_set():
    recorder = _Recorder()
    EngineStatsReporter(recorder).report(_stats(None))
    assert not recorder.samples and not any("kv_offload" in key[0] for key in {**recorder.counters, **recorder.gauges})
    assert recorder.gauges[("raylm_num_requests_loading",)] == 0


def test_status_summary_of_each_tier():
    host = TierStats("host", 4 * GiB, stored_bytes=int(1.2 * GiB), hits=93, misses=7)
    disk = TierStats("disk", 64 * GiB, stored_bytes=GiB // 2, errors={"corrupt": 2, "write": 1, "lost": 0})
    cluster = TierStats("cluster", 512 << 20, stored_bytes=0, hits=1, misses=2)
    assert kv_offload_summary((host, disk, cluster)) == (
        "host 1.2/4.0 GiB 93% hits, disk 0.5/64.0 GiB no loads (errors: 2 corrupt, 1 write), "
        "cluster 0.0/512.0 MiB 33% hits")
    assert kv_offload_summary(None) == "off"
