"""Single-replica engine speed: warm-up, 512-token prefill and single-stream decode.

Runs the bundled model's engine (``workers.LLM``, one sequence) in float32 (its GGUF blocks
kept, as served by default) and bfloat16 in one process and, given llama.cpp's
``llama-bench`` binary and a GGUF of the same model (``--llama-bench PATH --llama-model PATH``,
or the environment variables ``RAYLM_LLAMA_BENCH`` and ``RAYLM_LLAMA_MODEL``), runs
``llama-bench -p 512 -n 128 -t <cores>`` on it and prints our ratios to it.

    python -m raylm.benchmarks.model_bench [--model NAME] [--prompt-len 512] [--decode-tokens 128]
        [--llama-bench PATH --llama-model PATH.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM


def _timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_dtype(model_name: str, dtype: str, prompt_len: int, decode_tokens: int) -> dict[str, float]:
    """One replica's engine (``workers.LLM``, one sequence, prefix caching off), as served.

    Prompt tokens/s: the prompt and one output token. Decode tokens/s: ``decode_tokens``
    more output tokens after a 128-token prompt, the difference of two timed runs, so the
    prompt and the first token are not counted (llama-bench's ``tg`` has no prompt either).
    """
    start = time.perf_counter()
    llm = LLM(model_name, dtype, enable_prefix_caching=False, max_num_seqs=1,
              max_model_len=prompt_len + decode_tokens + 1, max_num_batched_tokens=max(512, prompt_len), warmup=True)
    warmup_s = time.perf_counter() - start
    vocab = llm.engine.config.vocab_size
    prompt = np.random.RandomState(0).randint(100, vocab, size=prompt_len).tolist()

    def run(tokens: list[int], new_tokens: int) -> None:
        llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))

    run(prompt, 1)  # anything not compiled by the warm-up
    prefill_s = _timed(lambda: run(prompt, 1), 5)
    short = prompt[:128]
    run(short, decode_tokens + 1)
    decode_s = _timed(lambda: run(short, decode_tokens + 1), 3) - _timed(lambda: run(short, 1), 3)
    return {
        "warmup_s": warmup_s,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
    }


def llama_bench(binary: Path | None, model: Path | None, prompt_len: int, decode_tokens: int) -> dict[str, float] | None:
    """pp/tg tokens/s of llama.cpp's ``llama-bench`` on ``model``; None when either is not given."""
    if binary is None or model is None:
        return None
    for path in (binary, model):
        if not path.is_file():
            raise SystemExit(f"model_bench: {path} does not exist")
    out = subprocess.run(
        [str(binary), "-m", str(model), "-p", str(prompt_len), "-n", str(decode_tokens), "-t",
         str(os.cpu_count()), "-o", "json"],
        capture_output=True, text=True, check=True,
    ).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt_len and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == decode_tokens and r["n_prompt"] == 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--llama-bench", type=Path, default=os.environ.get("RAYLM_LLAMA_BENCH"),
                        help="llama.cpp's llama-bench binary (default: $RAYLM_LLAMA_BENCH)")
    parser.add_argument("--llama-model", type=Path, default=os.environ.get("RAYLM_LLAMA_MODEL"),
                        help="GGUF of the same model for llama-bench, e.g. its F16 copy (default: $RAYLM_LLAMA_MODEL)")
    args = parser.parse_args()

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores, model {args.model}")
    results = {d: bench_dtype(args.model, d, args.prompt_len, args.decode_tokens) for d in ("float32", "bfloat16")}
    peer = llama_bench(args.llama_bench, args.llama_model, args.prompt_len, args.decode_tokens)
    print(f"{'':24}{'float32':>12}{'bfloat16':>12}" + (f"{'llama.cpp F16':>15}" if peer else ""))
    for key, label in [
        ("warmup_s", "engine warm-up (s)"),
        ("prefill_tok_s", f"prefill pp{args.prompt_len} (tok/s)"),
        ("decode_tok_s", f"decode tg{args.decode_tokens} (tok/s)"),
    ]:
        row = f"{label:24}{results['float32'][key]:12.2f}{results['bfloat16'][key]:12.2f}"
        if peer and key in peer:
            row += f"{peer[key]:15.2f}"
        print(row)
    if peer:
        for key in ("prefill_tok_s", "decode_tok_s"):
            ratios = ", ".join(f"{d} {results[d][key] / peer[key]:.2f}x" for d in results)
            print(f"ratio to llama.cpp F16, {key}: {ratios}")
    else:
        print("no llama.cpp comparison: give --llama-bench and --llama-model (or RAYLM_LLAMA_BENCH / RAYLM_LLAMA_MODEL)")


if __name__ == "__main__":
    main()
