"""A downloaded GGUF file served as stored: memory, load time, TTFT and decode speed, against llama.cpp.

Why: the files people serve are 3-8B K-quants (benchmarks/make_test_ggufs.py writes such files with
random weights). For each compute mode (exact: float32 sums over the weights as stored; integer:
int8 activations, ``model.activation_quantization: int8``) a child process builds one replica's
engine (``workers.LLM``, the file's matrices kept as blocks) and reports:

- the file's size, the weights as held, the KV pool's bytes, the process's resident memory after the warm-up and its
  peak (``ru_maxrss``), the load time (weights, the integer mode's packing as a replica packs while it
  loads, and tokenizer) and the warm-up (every bucket compiled);
- TTFT of a 512-token prompt (one output token, median of 3), single-stream decode tokens/s
  (128 tokens after a 128-token prompt, the prompt's time subtracted) and 16-way decode
  tokens/s (16 sequences of 64 tokens after 128-token prompts, the prompts' time subtracted).

In the integer mode a mixture of experts' routed experts run the grouped integer kernel where their
type has one (model/quantization/activations.py); where they stay exact (a float or fp8 stack) the
output says so under the table.

With llama.cpp's ``llama-bench`` (``--llama-bench``; default: the one
``shared/peers/llama-server.sh build`` makes) it runs ``-p 512 -n 128`` on the same file and on
``--peer-f16`` if given, with all cores, and prints raylm's ratios to the better of them:
TTFT against 512 / pp512, single stream against tg128. ``--no-repack`` runs it with ``--repack 0``:
on Intel machines that report AMX, ggml's extra weight buffers fail an assertion on a deepseek2
file (``GGML_ASSERT(*cur_backend_id != -1)``) as they crash llama-server at load
(shared/peers/llama-server.sh serves with ``--no-repack`` for that reason).

    python -m raylm.benchmarks.gguf_file_bench FILE.gguf [--peer-f16 F16.gguf] [--modes exact,integer] [--no-repack]
        [--wide-modes integer] [--llama-repetitions 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raylm.benchmarks.make_test_ggufs import QUANTIZE

LLAMA_BENCH = QUANTIZE.parent / "llama-bench"
PROMPT, SHORT, DECODE, WIDE, WIDE_TOKENS = 512, 128, 128, 16, 64


def _rss_gib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 2**20


def bench_mode(path: str, mode: str, wide: bool = True) -> dict[str, Any]:
    """One mode's figures, in this process (run it in a child: ``--child``); ``wide``: with the
    16-way figure (the longest to measure on a big file)."""
    import jax
    import numpy as np

    from raylm.model.loaders.load import load_model
    from raylm.model.quantization.int8_panels import Int8Panels
    from raylm.model.quantization.quant_array import weight_bytes
    from raylm.model.runtime.host_memory import release_freed_heap
    from raylm.workers.core.sampling_params import SamplingParams
    from raylm.workers.engine.llm import LLM

    start = time.perf_counter()
    integer = "int8" if mode == "integer" else "none"
    model = load_model(path, "float32", keep_blocks=True, activation_quantization=integer)  # as a replica loads
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(model, "float32", activation_quantization=integer,
              enable_prefix_caching=False, max_num_seqs=WIDE, max_model_len=PROMPT + DECODE + 1,
              max_num_batched_tokens=PROMPT, num_kv_blocks=WIDE * (PROMPT + DECODE) // 16 + 8, warmup=True)
    del model
    release_freed_heap()  # as make_engine does once the loaded form is dropped
    warmup_s = time.perf_counter() - start
    vocab = llm.engine.config.vocab_size
    rng = np.random.RandomState(0)

    def run(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start

    def median(fn, repeats: int) -> float:
        return statistics.median(fn() for _ in range(repeats))

    long = [rng.randint(100, vocab, size=PROMPT).tolist()]
    run(long, 1)
    ttft = median(lambda: run(long, 1), 3)
    short = [rng.randint(100, vocab, size=SHORT).tolist()]
    run(short, DECODE + 1)
    single = DECODE / (median(lambda: run(short, DECODE + 1), 2) - median(lambda: run(short, 1), 2))
    wide_tok_s = None
    if wide:
        prompts = [rng.randint(100, vocab, size=SHORT).tolist() for _ in range(WIDE)]
        run(prompts, WIDE_TOKENS + 1)
        wide_s = median(lambda: run(prompts, WIDE_TOKENS + 1), 2) - median(lambda: run(prompts, 1), 2)
        wide_tok_s = WIDE * WIDE_TOKENS / wide_s
    stacks = [lp.w_experts_gate_up for lp in llm.engine.runner.params.layers if lp.w_experts_gate_up is not None]
    exact_experts = mode == "integer" and any(not isinstance(w, Int8Panels) for w in stacks)
    return {
        "note": "routed experts exact (their type has no integer kernel)" if exact_experts else None,
        "file_gib": Path(path).stat().st_size / 2**30,
        "weights_gib": weight_bytes(llm.engine.model.params) / 2**30,
        "kv_pool_gib": sum(x.nbytes for x in jax.tree_util.tree_leaves(llm.engine.runner.kv)) / 2**30,
        "rss_gib": _rss_gib(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "ttft_512_s": ttft,
        "single_tok_s": single,
        "wide_tok_s": wide_tok_s,
    }


def llama_bench(binary: Path, model: Path, repack: bool = True, repetitions: int = 5) -> dict[str, float]:
    """llama-bench's pp512 / tg128 tokens/s on ``model``, all cores (``repack``: ggml's extra
    weight buffers, llama-bench's default; ``repetitions``: runs averaged, llama-bench's default 5)."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(PROMPT), "-n", str(DECODE), "-t",
                          str(os.cpu_count()), "-r", str(repetitions), "-o", "json",
                          *([] if repack else ["--repack", "0"])],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == PROMPT and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == DECODE and r["n_prompt"] == 0)
    return {"ttft_512_s": PROMPT / pp, "single_tok_s": tg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--modes", default="exact,integer")
    ap.add_argument("--peer-f16", type=Path, default=None, help="the same model as F16, for llama-bench")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    ap.add_argument("--no-repack", action="store_true", help="llama-bench --repack 0 (see the module docstring)")
    ap.add_argument("--wide-modes", default=None,
                    help="the modes that measure 16-way decode (default: all; at 8B each takes ~20 min on 2 cores)")
    ap.add_argument("--llama-repetitions", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    wide_modes = a.modes.split(",") if a.wide_modes is None else a.wide_modes.split(",")
    if a.child:
        print("RESULT " + json.dumps(bench_mode(str(a.file), a.child, wide=a.child in wide_modes)), flush=True)
        return
    results: dict[str, dict[str, Any]] = {}
    for mode in a.modes.split(","):
        out = subprocess.run([sys.executable, "-m", "raylm.benchmarks.gguf_file_bench", str(a.file), "--child", mode,
                              "--wide-modes", ",".join(wide_modes)], capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(line[7:])
        print(f"{mode}: {line[7:]}", flush=True)  # (kept should a peer's run fail)
    peers: dict[str, dict[str, float]] = {}
    if a.llama_bench.is_file():
        for name, peer in (("same file", a.file), ("F16", a.peer_f16)):
            if peer is None:
                continue
            try:
                peers[name] = llama_bench(a.llama_bench, peer, repack=not a.no_repack, repetitions=a.llama_repetitions)
            except subprocess.CalledProcessError as error:
                print(f"llama-bench on {peer} failed ({error}); on an Intel AMX machine try --no-repack", flush=True)
    keys = ["file_gib", "weights_gib", "kv_pool_gib", "rss_gib", "peak_rss_gib", "load_s", "warmup_s", "ttft_512_s",
            "single_tok_s", "wide_tok_s"]
    columns = [*results, *(f"llama {p}" for p in peers)]
    print(f"{a.file.name}, {os.cpu_count()} cores")
    print(f"{'':16}" + "".join(f"{c:>16}" for c in columns))
    for key in keys:
        row = [results[m].get(key) for m in results] + [peers[p].get(key) for p in peers]
        print(f"{key:16}" + "".join(f"{v:16.3f}" if v is not None else f"{'':16}" for v in row))
    for mode, r in results.items():
        if r.get("note"):
            print(f"{mode}: {r['note']}")
    if peers:
        best_ttft = min(p["ttft_512_s"] for p in peers.values())
        best_tg = max(p["single_tok_s"] for p in peers.values())
        for mode, r in results.items():
            held = r["rss_gib"] - r["kv_pool_gib"]
            print(f"{mode}: single stream {r['single_tok_s'] / best_tg:.2f}x the better llama.cpp, "
                  f"TTFT(512) {r['ttft_512_s'] / best_ttft:.2f}x, resident {r['rss_gib'] / r['file_gib']:.2f}x "
                  f"the file ({held / r['file_gib']:.2f}x without the KV pool)")


if __name__ == "__main__":
    main()
