"""An MoE replica's layout and load as the engine reports them: through Ray as plain data, into
the routed-tokens counter (increments per layer and expert), and as ``raylm status`` shows them.
(The counts themselves, from a real engine: tests/model/test_moe.py.)"""

from __future__ import annotations

from raylm.cache.block_pool import PoolStats
from raylm.deploy.status_command import experts_summary
from raylm.workers.core.engine_stats import EngineStats, MoeStats
from raylm.workers.serve.replica_metrics import EngineStatsReporter

POOL = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                 prefix_queries=0, prefix_hits=0)


def _stats(moe: MoeStats | None) -> EngineStats:
    return EngineStats(running=0, waiting=0, waiting_tokens=0, work_tokens=0, tokens_stored=0, token_capacity=0,
                       num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0, pool=POOL, moe=moe)


def _moe(routed: tuple[tuple[int, ...], ...]) -> MoeStats:
    return MoeStats(expert_parallel_size=2, tensor_parallel_size=1, num_experts=4, sparse_layers=(1, 3),
                    routed_tokens=routed)


class _Recorder:
    """WorkerMetrics' ``inc`` and ``set``, recording the routed-token increments."""

    def __init__(self) -> None:
        self.routed: dict[tuple[str, str], float] = {}

    def set(self, name: str, value: float) -> None:
        pass

    def inc(self, name: str, value: float, **tags: str) -> None:
        if name == "raylm_moe_routed_tokens_total" and value > 0:
            key = (tags["layer"], tags["expert"])
            self.routed[key] = self.routed.get(key, 0) + value


def test_layout_and_load_cross_ray_as_plain_data_and_read_in_status():
    stats = _stats(_moe(((6, 2, 0, 0), (2, 2, 2, 2))))
    assert EngineStats.from_dict(stats.as_dict()) == stats
    assert EngineStats.from_dict(_stats(None).as_dict()).moe is None
    assert stats.moe.experts_per_device == 2 and stats.moe.imbalance == 3.0  # 6 of a mean of 2
    assert experts_summary(stats.moe) == "ep 2 x tp 1, 2 of 4 per device, busiest 3.00x mean"
    assert experts_summary(_moe(((0,) * 4,) * 2)) == "ep 2 x tp 1, 2 of 4 per device"
    assert experts_summary(None) == "-"


def test_reporter_counts_each_layer_and_experts_new_tokens():
    recorder = _Recorder()
    reporter = EngineStatsReporter(recorder)
    reporter.report(_stats(_moe(((6, 2, 0, 0), (2, 2, 2, 2)))))
    reporter.report(_stats(_moe(((9, 2, 0, 1), (2, 2, 2, 2)))))
    assert recorder.routed == {("1", "0"): 9, ("1", "1"): 2, ("1", "3"): 1, ("3", "0"): 2, ("3", "1"): 2,
                               ("3", "2"): 2, ("3", "3"): 2}
