"""Each step kind's achieved GFLOP/s over a ``raylm bench`` run, against the float32 GEMM peak
of the machine the bench runs on.

The worker replicas count, per step kind (prefill, decode, mixed, verify:
``workers/engine/step_work.py``), the steps they ran, the tokens the model computed in them, the
wall seconds of their programs and the operations they did (``model/decoder/flop_count.py``). Two
readings around a workload give the run's share: operations / seconds is the achieved rate,
in integer GOP/s when the replicas multiply in integers (``activation_quantization: int8``),
else GFLOP/s. The peak it is held against is XLA's own float32 dot on a large GEMM, measured
once by the bench (``prompt_gemm_bench.float32_peak``) on its own machine: the replicas' when
the bench runs beside them, as it does with ``--ray-app`` on one machine.
"""

from __future__ import annotations

from typing import Any

from raylm.workers.core.engine_stats import ComputeStats, StepWork

PEAK_SHAPE = (2048, 4096, 4096)  # M, N, K: past XLA's plateau on CPU (prompt_gemm_bench's default)
PEAK_ROUNDS = 3


def float32_gemm_peak() -> float:
    """GFLOP/s of XLA's float32 dot on a ``PEAK_SHAPE`` GEMM here (median of ``PEAK_ROUNDS`` calls)."""
    from raylm.benchmarks.prompt_gemm_bench import float32_peak

    return float32_peak(*PEAK_SHAPE, PEAK_ROUNDS)[0]


def step_rates(before: ComputeStats | None, after: ComputeStats | None, peak: float | None) -> dict[str, Any] | None:
    """Per step kind that ran between two readings: steps, tokens, seconds, ``rate`` (GFLOP/s,
    or GOP/s: ``unit``) and ``percent_of_peak`` (None without a ``peak``); None when the
    replicas report no step counters (another server, or none answered)."""
    if before is None or after is None:
        return None
    kinds = {}
    for kind, now in after.kinds.items():
        then = before.kinds.get(kind, StepWork())
        steps, seconds = now.steps - then.steps, now.seconds - then.seconds
        if not steps:
            continue
        rate = (now.flops - then.flops) / seconds / 1e9 if seconds > 0 else None
        kinds[kind] = {"steps": steps, "tokens": now.tokens - then.tokens, "seconds": seconds, "rate": rate,
                       "percent_of_peak": 100 * rate / peak if rate is not None and peak else None}
    return {"unit": "GOP/s" if after.integer_matmuls else "GFLOP/s", "kinds": kinds}


def format_step_rates(name: str, rates: dict[str, Any], peak: float | None) -> list[str]:
    """The lines of one endpoint's (``name``) step kinds over a run, as ``step_rates`` gives them."""
    against = f"{peak:.0f} GFLOP/s" if peak else "not measured"
    integer = " (integer operations)" if rates["unit"] == "GOP/s" else ""
    rows = [["step kind", "steps", "tokens", "seconds", rates["unit"], "% peak"]]
    for kind, k in rates["kinds"].items():
        rows.append([kind, str(k["steps"]), str(k["tokens"]), f"{k['seconds']:.3f}",
                     "-" if k["rate"] is None else f"{k['rate']:.0f}",
                     "-" if k["percent_of_peak"] is None else f"{k['percent_of_peak']:.0f}%"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"  {name}: model steps over the measured run, all replicas{integer}; % of the float32 GEMM peak "
             f"of the bench's machine ({against})"]
    lines += ["    " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
              for row in rows]
    return lines
