"""The accelerator benchmark of issue 70, as one prepared script: a random-weight Llama (1B or 8B
shapes, bfloat16 on a GPU; ``benchmarks/gpu_bench_model.py``) timed part by part, one printed
line per figure, the issue's targets checked, and everything in ``--json``.

Parts (``--parts``, all by default; each catches and prints its own failure):

- ``check``: greedy agreement: a prompt prefilled by the jnp path, then a few decode steps with
  attention by the Pallas kernel and by the jnp path from the same pool; tokens must agree
  (else MISMATCH), the first step's largest logit difference is printed beside the jnp logits'
  smallest top-2 gap (in bfloat16 a gap below the difference is a near tie either path may take).
- ``attention``: ``gpu_paged_attention`` (the Pallas kernel on a GPU) against the jnp
  ``paged_attention`` at 64 (and 1) sequences x 4096 keys, the model's heads (1B: 32 of 64, 8 KV
  heads), bf16 pool, one layer of a 4-layer pool at a traced layer index; block tables exactly
  the context wide. Target: >= 5x.
- ``decode``: ``decode_program`` (greedy sampling inside, attention by the kernel) at 1 and 64
  rows of 2048-token contexts, 1 and 8 steps a call: output tok/s; single stream against the HBM
  roofline (weight bytes / bandwidth; target >= 50%), 64 streams against 1 (target >= 8x).
- ``prefill``: ``prefill_program`` on 8 prompts of 2048 tokens: tok/s and FLOP/s
  (``model.decoder.flop_count``) against peak bf16 (target >= 40%).
- ``fp8``: single-stream decode with fp8 weights (``quantize_params``) against bf16 (target >= 1.6x).

On a CPU the kernel runs in Pallas interpret mode (``--shape tiny``: the smoke run, ~20 s of CPU
time, mostly compiles).
``--lower-only`` traces each part's programs and lowers them for ``cuda`` without running
anything (no GPU, no weights in memory): the check before spending device time.

It imports jax, numpy and raylm's model and workers.runner code only. raylm's quantization
imports the pure-Python ``gguf`` package (``quant_array`` -> ``gguf_blocks`` -> ``gguf_transcode``,
whose tables are built from it at import), which the GPU image lacks: the run carries the venv's
copy. On the ``run`` device tool, with ``carry=[".venv/lib/python3.11/site-packages/gguf"]``:

    mkdir -p /tmp/shim && ln -sfn $PWD /tmp/shim/raylm && PYTHONPATH=/tmp/shim:$PWD/.venv/lib/python3.11/site-packages python3 -m raylm.benchmarks.gpu_bench --shape 1b --json $OUT/gpu.json

(``.venv/lib/python3.11/site-packages`` holds only the carried ``gguf`` there; the repository is
importable as ``raylm`` through the symlink.) Give it ``timeout_s=480``: nothing here has timed it
on a GPU yet (about 14 programs to compile); the JSON is rewritten after every part, so a run cut
short keeps what it measured, and ``--parts`` splits the work over calls. The 1B run is the
issue's; ``--shape 8b`` (twice the layers, so about twice the compile time) is a second call,
time permitting. Before either: ``--lower-only`` here, on the CPU, for the same shape.

Here: ``python -m raylm.benchmarks.gpu_bench --shape tiny`` (the smoke run, float32 so the
kernel computes exactly), ``--shape 1b --lower-only``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from raylm.benchmarks import gpu_bench_model as bm
from raylm.model.decoder.attention import paged_attention
from raylm.model.decoder.flop_count import ModelFlops
from raylm.model.kernels import interpreting_gpu_kernels, lowering_for_every_platform
from raylm.model.kernels.pallas.paged_attention import gpu_paged_attention
from raylm.model.quantization.quant_array import quantize_params, weight_bytes
from raylm.workers.runner.programs import decode_program, prefill_program

PARTS = ("check", "attention", "decode", "prefill", "fp8")
TRITON_CALL = "__gpu$xla.gpu.triton"
CHECK_ROWS, CHECK_PROMPT, CHECK_STEPS = 4, 48, 4
# The targets: figure name -> least value.
TARGETS = {"attention.speedup_64": 5.0, "decode.roofline_fraction_1": 0.5, "decode.streams_64_over_1": 8.0,
           "prefill.peak_fraction": 0.4, "fp8.speedup_1": 1.6}


class Case(NamedTuple):
    """One jitted program's call to time or lower: ``program(*args, **kwargs)``; with ``pool_at``
    the program donates ``args[pool_at]`` (so no other case may hold that pool) and returns the
    updated pool at ``output[pool_at]``."""

    label: str
    program: Callable
    args: tuple
    kwargs: dict
    pool_at: int | None = 1


class Bench:
    """The run's model, options and results; each part adds its figures."""

    def __init__(self, shape: str, dtype: str, rounds: int, hbm_tbps: float | None, peak_tflops: float | None,
                 abstract: bool) -> None:
        self.config = bm.model_config(shape)
        self.sizes = bm.SIZES[shape]
        self.dtype = jnp.dtype(dtype)
        self.rounds, self.hbm_tbps, self.peak_tflops, self.abstract = rounds, hbm_tbps, peak_tflops, abstract
        self.figures: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.lowered: dict[str, int] = {}
        self.params = bm.maybe_abstract(abstract, bm.random_params, self.config, self.dtype)

    def report(self, name: str, value: float, unit: str = "", note: str = "") -> None:
        self.figures[name] = float(value)
        target = f"  (target >= {TARGETS[name]:g}: {'met' if value >= TARGETS[name] else 'MISSED'})" \
            if name in TARGETS else ""
        print(f"{name} = {value:.4g}{' ' + unit if unit else ''}{note}{target}", flush=True)

    def pool(self, num_blocks: int, num_layers: int | None = None) -> Any:
        return bm.maybe_abstract(self.abstract, bm.random_pool, self.config, num_blocks, self.dtype, num_layers)

    def median_seconds(self, case: Case) -> float:
        """Compile and warm up, then the median wall time of ``rounds`` calls (each waited for)."""
        args = list(case.args)

        def call() -> None:
            out = case.program(*args, **case.kwargs)
            if case.pool_at is not None:
                args[case.pool_at] = out[case.pool_at]
            jax.block_until_ready(out)

        start = time.perf_counter()
        call()
        print(f"  ({case.label}: compiled and ran once in {time.perf_counter() - start:.1f} s)", flush=True)
        call()
        times = []
        for _ in range(self.rounds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def lower(self, case: Case) -> None:
        """Trace ``case`` and lower it for an NVIDIA GPU; count its Triton kernel calls."""
        with lowering_for_every_platform():
            text = case.program.trace(*case.args, **case.kwargs).lower(lowering_platforms=("cuda",)).as_text()
        self.lowered[case.label] = text.count(TRITON_CALL)
        print(f"lowered {case.label} for cuda: {self.lowered[case.label]} Triton calls", flush=True)

    def times(self, cases: list[Case]) -> dict[str, float] | None:
        """Median seconds by label, or None after lowering them (``--lower-only``)."""
        if self.abstract:
            for case in cases:
                self.lower(case)
            return None
        return {case.label: self.median_seconds(case) for case in cases}


def _attention_kernel(q, k_pool, v_pool, layer, tables, positions, context_lens, valid):
    return gpu_paged_attention(q, k_pool, v_pool, layer, tables, positions, context_lens, valid)


def _attention_jnp(q, k_pool, v_pool, layer, tables, positions, context_lens, valid):
    return paged_attention(q, k_pool, v_pool, layer, tables, positions, context_lens, valid)


def part_attention(b: Bench) -> None:
    s, c = b.sizes, b.config
    rows_max = max(s.attention_rows)
    _, num_blocks = bm.block_tables(rows_max, s.attention_context, width=-(-s.attention_context // bm.BLOCK_SIZE))
    kv = b.pool(num_blocks, s.attention_layers)
    programs = {"kernel": jax.jit(_attention_kernel), "jnp": jax.jit(_attention_jnp)}
    outputs = {}
    for rows in s.attention_rows:
        tables, _ = bm.block_tables(rows, s.attention_context, width=-(-s.attention_context // bm.BLOCK_SIZE))
        q = jax.random.normal(jax.random.key(rows), (rows, 1, c.num_heads, c.head_dim), b.dtype)
        args = (q, kv.k, kv.v, jnp.int32(s.attention_layers - 1), jnp.asarray(tables),
                jnp.full((rows, 1), s.attention_context - 1, jnp.int32),
                jnp.full((rows,), s.attention_context, jnp.int32), jnp.ones((rows, 1), bool))
        cases = [Case(f"attention.{name}[{rows}x{s.attention_context}]", program, args, {}, None)
                 for name, program in programs.items()]
        times = b.times(cases)
        if times is None:
            continue
        for name, program in programs.items():
            outputs[name] = np.asarray(program(*args), np.float32)
        kernel_s, jnp_s = times[cases[0].label], times[cases[1].label]
        b.report(f"attention.kernel_ms_{rows}", kernel_s * 1e3, "ms", f" ({rows} x {s.attention_context} keys)")
        b.report(f"attention.jnp_ms_{rows}", jnp_s * 1e3, "ms")
        b.report(f"attention.speedup_{rows}", jnp_s / kernel_s, "x")
        b.report(f"attention.max_abs_diff_{rows}", float(np.max(np.abs(outputs["kernel"] - outputs["jnp"]))))


def _decode_case(b: Bench, params: Any, kv: Any, rows: int, steps: int, tag: str = "") -> Case:
    args = bm.decode_args(b.config, params, kv, rows, b.sizes.decode_context, steps)
    return Case(f"decode{tag}[{rows}x{steps}]", decode_program, args, bm.decode_kwargs(b.config, steps, True))


def _decode_pool(b: Bench, rows: int) -> Any:
    return b.pool(bm.block_tables(rows, b.sizes.decode_context + max(b.sizes.decode_steps))[1])


def part_decode(b: Bench) -> None:
    s = b.sizes
    single, many = s.decode_rows[0], s.decode_rows[-1]
    rate: dict[tuple[int, int], float] = {}
    for rows in s.decode_rows:
        for steps in s.decode_steps:
            times = b.times([case := _decode_case(b, b.params, _decode_pool(b, rows), rows, steps)])
            if times is None:
                continue
            rate[rows, steps] = rows * steps / times[case.label]
            b.report(f"decode.tok_s_{rows}x{steps}", rate[rows, steps], "tok/s",
                     f" ({rows} rows at {s.decode_context} context, {steps} steps a call)")
    if not rate:
        return
    steps = s.decode_steps[-1]
    b.report("decode.weight_bytes", weight_bytes(b.params), "B")
    if b.hbm_tbps:
        roofline = b.figures["decode.weight_bytes"] / (b.hbm_tbps * 1e12)
        b.report("decode.roofline_ms", roofline * 1e3, "ms", f" (the weights at {b.hbm_tbps:g} TB/s)")
        b.report("decode.roofline_fraction_1", roofline * rate[single, steps] / single)
    b.report(f"decode.streams_{many}_over_{single}", rate[many, steps] / rate[single, steps], "x")


def part_prefill(b: Bench) -> None:
    s, c = b.sizes, b.config
    _, num_blocks = bm.block_tables(s.prefill_rows, s.prefill_tokens)
    kv = b.pool(num_blocks)
    case = Case(f"prefill[{s.prefill_rows}x{s.prefill_tokens}]", prefill_program,
                bm.prefill_args(c, b.params, kv, s.prefill_rows, s.prefill_tokens), bm.prefill_kwargs(c, True))
    times = b.times([case])
    if times is None:
        return
    seconds, tokens = times[case.label], s.prefill_rows * s.prefill_tokens
    flops = ModelFlops.of(c, b.params).flops(s.prefill_rows, np.zeros(s.prefill_rows), np.full(s.prefill_rows,
                                                                                                s.prefill_tokens))
    b.report("prefill.tok_s", tokens / seconds, "tok/s", f" ({s.prefill_rows} prompts of {s.prefill_tokens})")
    b.report("prefill.tflop_s", flops / seconds / 1e12, "TFLOP/s")
    if b.peak_tflops:
        b.report("prefill.peak_fraction", flops / seconds / 1e12 / b.peak_tflops, "",
                 f" (of {b.peak_tflops:g} TFLOP/s)")


def part_fp8(b: Bench) -> None:
    single, steps = b.sizes.decode_rows[0], b.sizes.decode_steps[-1]
    fp8 = bm.maybe_abstract(b.abstract, quantize_params, b.params, "fp8")
    cases = [_decode_case(b, b.params, _decode_pool(b, single), single, steps, f".{b.dtype.name}"),
             _decode_case(b, fp8, _decode_pool(b, single), single, steps, ".fp8")]
    times = b.times(cases)
    if times is None:
        return
    bf16_rate, fp8_rate = (single * steps / times[case.label] for case in cases)
    b.report(f"fp8.tok_s_{single}", fp8_rate, "tok/s", f" ({b.dtype.name}: {bf16_rate:.4g} tok/s; weights "
             f"{weight_bytes(fp8) / 1e6:.1f} MB against {weight_bytes(b.params) / 1e6:.1f} MB)")
    b.report(f"fp8.speedup_{single}", fp8_rate / bf16_rate, "x")


def part_check(b: Bench) -> None:
    c = b.config
    _, num_blocks = bm.block_tables(CHECK_ROWS, CHECK_PROMPT + CHECK_STEPS)
    kv = b.pool(num_blocks)
    tables, _ = bm.block_tables(CHECK_ROWS, CHECK_PROMPT + CHECK_STEPS)
    prompt = bm.prefill_args(c, b.params, kv, CHECK_ROWS, CHECK_PROMPT)
    prompt = (*prompt[:6], jnp.asarray(tables), *prompt[7:])  # the decode steps' blocks too
    prefill = Case("check.prefill_jnp", prefill_program, prompt, bm.prefill_kwargs(c, False))

    def decode(kv: Any, first: jax.Array, gpu_kernels: bool) -> Case:
        args = (b.params, kv, first, jnp.full((CHECK_ROWS,), CHECK_PROMPT, jnp.int32), jnp.asarray(tables),
                jnp.full((CHECK_ROWS,), CHECK_PROMPT + CHECK_STEPS, jnp.int32), bm.greedy_rows(CHECK_ROWS, c))
        return Case(f"check.decode_{'kernel' if gpu_kernels else 'jnp'}", decode_program, args,
                    bm.decode_kwargs(c, CHECK_STEPS, gpu_kernels, return_logits=True))

    if b.abstract:
        first = jax.ShapeDtypeStruct((CHECK_ROWS,), jnp.int32)
        b.times([prefill, decode(kv, first, True), decode(kv, first, False)])
        return
    result, kv, *_ = prefill.program(*prefill.args, **prefill.kwargs)
    out = {}
    for gpu_kernels in (True, False):
        case = decode(jax.tree_util.tree_map(jnp.copy, kv), result.tokens, gpu_kernels)
        results, _, _, logits, _ = case.program(*case.args, **case.kwargs)
        out[gpu_kernels] = np.asarray(results.tokens), np.asarray(logits[0], np.float32)
    (kernel_tokens, kernel_logits), (jnp_tokens, jnp_logits) = out[True], out[False]
    agree = int(np.sum(kernel_tokens == jnp_tokens))
    b.report("check.tokens_agreeing", agree, f"of {kernel_tokens.size}",
             f" ({CHECK_ROWS} rows, {CHECK_STEPS} greedy steps after a {CHECK_PROMPT}-token prompt)")
    b.report("check.first_step_max_logit_diff", float(np.max(np.abs(kernel_logits - jnp_logits))))
    top2 = np.sort(jnp_logits, axis=-1)[:, -2:]
    b.report("check.first_step_min_top2_gap", float(np.min(top2[:, 1] - top2[:, 0])), "",
             " (a gap below the logit difference is a near tie the two paths may break apart)")
    b.report("check.logits_finite", float(np.isfinite(kernel_logits).all() and np.isfinite(jnp_logits).all()))
    if agree != kernel_tokens.size:
        print(f"MISMATCH: the kernel's greedy tokens differ from the jnp path's:\n{kernel_tokens.T}\n{jnp_tokens.T}",
              flush=True)


RUNNERS: dict[str, Callable[[Bench], None]] = {"check": part_check, "attention": part_attention,
                                               "decode": part_decode, "prefill": part_prefill, "fp8": part_fp8}


def run_parts(bench: Bench, parts: list[str], after_each: Callable[[], None] = lambda: None) -> None:
    """Each part in turn, then ``after_each()``; a failing part's error is printed and kept, the
    others still run."""
    for part in parts:
        try:
            RUNNERS[part](bench)
        except Exception as e:  # noqa: BLE001 -- one part's failure must not lose the others' figures
            bench.errors[part] = f"{type(e).__name__}: {e}"
            print(f"{part} FAILED: {bench.errors[part]}", flush=True)
            traceback.print_exc(limit=4)
        after_each()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(bm.SHAPES), default="1b")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--json", help="write the figures there")
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per program (median)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="weights and pools (default bfloat16, float32 on a CPU: exact kernel, exact check)")
    parser.add_argument("--hbm-tbps", type=float, help="memory bandwidth (default by device kind: H200 4.8, H100 3.35)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default by device kind: H100/H200 989)")
    parser.add_argument("--lower-only", action="store_true", help="trace and lower each part's programs for cuda")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    device = jax.devices()[0]
    kind = device.device_kind
    interpret = device.platform == "cpu" and not args.lower_only
    dtype = args.dtype or ("float32" if device.platform == "cpu" and not args.lower_only else "bfloat16")
    print(f"device: {kind} ({device.platform}), jax {jax.__version__}, shape {args.shape}, {dtype}"
          f"{', Pallas interpret mode' if interpret else ''}{', lowering only' if args.lower_only else ''}", flush=True)
    hbm = args.hbm_tbps or bm.nominal(bm.HBM_TBPS, kind)
    peak = args.peak_tflops or bm.nominal(bm.PEAK_BF16_TFLOPS, kind)
    bench = Bench(args.shape, dtype, args.rounds, hbm, peak, abstract=args.lower_only)
    result = dict(device=kind, platform=device.platform, jax=jax.__version__, shape=args.shape, dtype=dtype,
                  parts=parts, interpret=interpret, hbm_tbps=hbm, peak_tflops=peak, figures=bench.figures,
                  errors=bench.errors, lowered=bench.lowered, targets=TARGETS)

    def write_json() -> None:  # after every part: a run cut short by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    with interpreting_gpu_kernels() if interpret else contextlib.nullcontext():
        run_parts(bench, parts, write_json)
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
