"""What a router replica costs to start: wall time and peak memory of a fresh interpreter that
imports ``raylm.router.app`` and loads the model's tokenizer (what ``OpenAIRouter.__init__``
does before serving), against the same with the engine imported too (JAX, the runner, the
scheduler), which is what a router replica paid while it imported the engine.

Each sample is a new process (imports are cached in a process), run alternately so both see
the same machine load; medians are reported. With ``--baseline REV`` the router of that
commit (``git archive``) is measured side by side as well.

    python -m raylm.benchmarks.router_footprint [--rounds 7] [--model NAME] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from raylm.benchmarks.source_trees import export_baseline, import_env

ROOT = Path(__file__).resolve().parents[1]
ROUTER = "import raylm.router.app"
ENGINE = "import raylm.router.app\nimport raylm.workers.engine.llm_engine"
CHILD = """
import json, resource, sys
{imports}
from raylm.model.config.model_info import load_model_info
load_model_info({model!r}).tokenizer
print(json.dumps({{"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "jax": "jax" in sys.modules, "modules": len(sys.modules)}}))
"""


def sample(root: Path, imports: str, model: str) -> dict[str, float]:
    """One fresh interpreter in ``root``: its wall time (start to exit) and what it reports."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(imports=imports, model=model)], cwd=root,
        env=import_env(root), capture_output=True, text=True, check=True,
    )
    return {"seconds": time.perf_counter() - start, **json.loads(done.stdout.splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--baseline", default=None, help="also measure this git revision's router")
    args = parser.parse_args()

    cases = {"router": (ROOT, ROUTER), "router + engine": (ROOT, ENGINE)}
    if args.baseline:
        cases[f"router at {args.baseline}"] = (export_baseline(args.baseline), ROUTER)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    names = list(cases)
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            samples[name].append(sample(*cases[name], args.model))

    router = {key: statistics.median(s[key] for s in samples["router"]) for key in ("seconds", "peak_rss_mib")}
    print(f"{args.model}, medians of {args.rounds} fresh interpreters each")
    print(f"{'':24}{'start (s)':>10}{'peak RSS (MiB)':>16}{'modules':>9}{'jax':>5}{'time / router':>15}{'RSS / router':>14}")
    for name, runs in samples.items():
        seconds = statistics.median(s["seconds"] for s in runs)
        rss = statistics.median(s["peak_rss_mib"] for s in runs)
        print(f"{name:24}{seconds:10.2f}{rss:16.0f}{int(runs[-1]['modules']):9d}{'yes' if runs[-1]['jax'] else 'no':>5}"
              f"{seconds / router['seconds']:14.2f}x{rss / router['peak_rss_mib']:13.2f}x")


if __name__ == "__main__":
    main()
