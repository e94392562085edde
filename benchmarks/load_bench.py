"""A checkpoint's load: time, the weights as held, and the process's memory at its peak.

Why: issue 65 asks that a load's peak RSS stay within 1.3x the weights it holds (an 8B model
must load on the machine that serves it) and that load time be reported. Each run is a child
process (a clean ``ru_maxrss``) that loads the weights alone (``load_checkpoint``: a GGUF file or
an HF safetensors directory; no tokenizer, no engine) and prints:

- ``load_s``: wall time of the load; ``weights_gib``: the parameters as held;
- ``peak_rss_gib``: ``ru_maxrss``, anonymous memory and mapped file pages together (what ``ps``
  and a container's memory limit see); ``peak_anon_gib``: anonymous memory alone, sampled every
  20 ms; ``rss_gib``: resident after the load.

    python -m raylm.benchmarks.load_bench FILE.gguf|HF_DIR [--expand] [--repeats N]

``--expand``: GGUF blocks and 16-bit matrices widened to float32 (``gguf_blocks: expand``),
else kept as stored (the default for a float32 model on one CPU device).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import threading
import time
from typing import Any


def _memory_gib(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 2**20


def load_once(path: str, keep_blocks: bool) -> dict[str, Any]:
    """One load in this process (run it in a fresh child)."""
    from raylm.model.loaders.load import load_checkpoint
    from raylm.model.quantization.quant_array import weight_bytes

    peak_anon = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _memory_gib("RssAnon:"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    _, params = load_checkpoint(path, "float32", keep_blocks=keep_blocks)
    load_s = time.perf_counter() - start
    done.set()
    sampler.join()
    return {"load_s": load_s, "weights_gib": weight_bytes(params) / 2**30, "rss_gib": _memory_gib("VmRSS:"),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_anon_gib": max(peak_anon[0], _memory_gib("RssAnon:"))}


def _child(path: str, keep_blocks: bool, out: Any) -> None:
    out.send(load_once(path, keep_blocks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--expand", action="store_true", help="widen blocks and 16-bit matrices to float32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    runs = []
    for _ in range(args.repeats):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(args.path, not args.expand, send))
        child.start()
        runs.append(receive.recv())
        child.join()
    summary = {key: [round(run[key], 2) for run in runs] for key in runs[0]}
    weights = statistics.median(summary["weights_gib"])
    summary["peak_rss_over_weights"] = [round(p / weights, 2) for p in summary["peak_rss_gib"]]
    summary["peak_anon_over_weights"] = [round(p / weights, 2) for p in summary["peak_anon_gib"]]
    print(f"{args.path}, {'kept as stored' if not args.expand else 'expanded to float32'}, {args.repeats} runs")
    for key, values in summary.items():
        print(f"{key:24s} {' '.join(f'{v:7.2f}' for v in values)}")


if __name__ == "__main__":
    main()
