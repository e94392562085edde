"""Speculative decoding on the bundled model: each proposer against plain decoding, same process.

For each proposer (``none``; ``ngram``; draft models cut from the target: ``self-int8`` = all
layers, int8 weights; ``layers-N`` = the first N layers, float; ``layers-N-int8``) and each
workload (``chat``: the reference prompts, chat-templated; ``grounded``: "repeat / edit this
code" prompts, where the answer copies the prompt), for a single stream (4 requests one
after the other) and 4 and 16 sequences at once: output tokens/s (offline ``workers.LLM``,
greedy, ``--new-tokens`` per request with EOS ignored, prefill included, timed on a second
run so nothing compiles), its ratio to ``none``, the acceptance rate and the mean accepted guesses per
verified row. Output is checked identical to ``none``'s on every run.

Per row of a batch it also prints how its decode steps went: tokens per step (plain steps,
which n-gram rows without a match take, count as steps of one token) and the share of steps
that verified guesses. ``--parts cost`` times one target step of R rows (a verify of k guesses
is R = k + 1 rows per sequence) and one draft step, in ms, at the contexts these workloads
reach, and for a single stream prints the ratio those costs predict from the measured steps
(the "model" column: tokens per step over the step's cost in plain steps, draft steps
included), so a measured ratio is checked against its explanation.

    python -m raylm.benchmarks.speculative_bench [--proposers none,ngram,self-int8] [--k 3]
        [--gguf-blocks auto|keep|expand]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raylm.benchmarks.quantization_bench import REFERENCE_PROMPTS
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.forward import forward
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.loaders.load import GGUF_BLOCKS_CHOICES, LoadedModel, keep_gguf_blocks, load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

CODE = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
# The code fenced, as users paste it: unfenced, the bundled model rewrites the function after
# its first lines instead of copying it (n-gram: 1.65 tokens per step against 1.94, k = 3).
FENCED_CODE = f"```python\n{CODE}```"
GROUNDED_PROMPTS: tuple[str, ...] = (
    f"Repeat this code exactly, then stop:\n\n{FENCED_CODE}",
    f"Rename the function to rolling_mean and give the whole code back:\n\n{FENCED_CODE}",
    f"Add a docstring line about the return value and give the whole code back:\n\n{FENCED_CODE}",
    f"Copy this function and add type hints to it:\n\n{FENCED_CODE}",
)
SINGLE_STREAM_REQUESTS = 4
# proposer name -> engine ``speculative`` mapping (None: plain decoding)
PROPOSERS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": dict(method="ngram"),  # the engine's defaults: the last 4..1 tokens
    "self-int8": dict(method="draft", quantization="int8"),
    "layers-6": dict(method="draft", num_layers=6),
    "layers-12-int8": dict(method="draft", num_layers=12, quantization="int8"),
    "layers-20-int8": dict(method="draft", num_layers=20, quantization="int8"),
}


def _prompts(model: LoadedModel, workload: str, count: int) -> list[dict]:
    texts = REFERENCE_PROMPTS if workload == "chat" else GROUNDED_PROMPTS
    tok = model.tokenizer
    return [
        {"prompt_token_ids": tok.encode_chat([{"role": "user", "content": texts[i % len(texts)]}], True)}
        for i in range(count)
    ]


def run_proposer(model: LoadedModel, spec: dict | None, k: int, workloads: list[str], batches: list[int],
                 new_tokens: int) -> dict[tuple[str, int], dict[str, Any]]:
    engine_spec = dict(spec, num_speculative_tokens=k) if spec else None
    llm = LLM(model, enable_prefix_caching=False, speculative=engine_spec)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for workload in workloads:
        for batch in batches:
            # Single stream: SINGLE_STREAM_REQUESTS prompts one after the other; else all at once.
            groups = ([[p] for p in _prompts(model, workload, SINGLE_STREAM_REQUESTS)] if batch == 1
                      else [_prompts(model, workload, batch)])
            for group in groups:
                llm.generate(group, params)  # compiles what these shapes need
            before = llm.engine.stats().spec
            start = time.perf_counter()
            results = [r for group in groups for r in llm.generate(group, params)]
            seconds = time.perf_counter() - start
            after = llm.engine.stats().spec
            tokens = sum(len(r.outputs[0].token_ids) for r in results)
            row: dict[str, Any] = {"tok_s": tokens / seconds, "tokens": [r.outputs[0].token_ids for r in results]}
            if spec:
                drafts = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                verifies = after.num_drafts - before.num_drafts
                row.update(acceptance=accepted / max(drafts, 1), mean_accepted=accepted / max(verifies, 1),
                           **_step_mix(tokens, len(results), accepted, verifies))
            out[(workload, batch)] = row
    return out


def _step_mix(tokens: int, requests: int, accepted: int, verifies: int) -> dict[str, float]:
    """Per sequence: decode steps taken (a request's first token comes from its prefill; a
    verify emits its accepted guesses plus one token, a plain step one token), tokens per step
    and the share of steps that verified guesses."""
    decoded = tokens - requests
    steps = decoded - accepted  # plain steps + verifies
    return {"tokens_per_step": decoded / max(steps, 1), "verify_share": verifies / max(steps, 1)}


def predicted_ratio(row: dict[str, Any], costs: dict[str, Any], proposer: str, k: int) -> float:
    """Single stream: the speed-up the cost model gives for the measured step mix. A plain
    step costs one 1-row target step; a verify a (k + 1)-row one, plus k draft steps for a
    draft model (its window, then a step per further guess; n-gram guesses cost no device
    time). Decode steps only: the measured ratio also carries each request's prefill."""
    target = costs["target"]
    verify = target[k + 1] + k * costs[proposer][1] if proposer in costs else target[k + 1]
    share = row["verify_share"]
    return row["tokens_per_step"] * target[1] / (share * verify + (1 - share) * target[1])


def cost_model(model: LoadedModel, proposers: list[str], k: int, context: int = 256,
               repeats: int = 20) -> dict[str, Any]:
    """Median ms of one target forward of R one-token rows (kernels path) at ``context`` keys
    (about where these workloads decode), and of each draft's."""
    from raylm.workers.core.speculation import SpeculativeConfig
    from raylm.workers.runner.draft_model import load_draft

    def timed(loaded: LoadedModel, rows: int) -> float:
        cfg = loaded.config
        kv = KVCache.create(cfg, 64, 16, jnp.float32)
        step = jax.jit(lambda p, kv, t, pos, bt: forward(p, cfg, t, pos, kv, bt, pos[:, 0] + 1, cpu_kernels=True),
                       donate_argnums=1)
        tokens = np.ones((rows, 1), np.int32)
        positions = np.full((rows, 1), context, np.int32)
        tables = np.tile(np.arange(1, 33, dtype=np.int32), (rows, 1))
        logits, kv = step(loaded.params, kv, tokens, positions, tables)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            logits, kv = step(loaded.params, kv, tokens, positions, tables)
            logits.block_until_ready()
            times.append((time.perf_counter() - start) * 1e3)
        return float(np.median(times))

    out: dict[str, Any] = {"target": {rows: timed(model, rows) for rows in sorted({1, 2, 4, 6, 8, 16, 32, k + 1})}}
    for name in proposers:
        spec = PROPOSERS[name]
        if spec and spec["method"] == "draft":
            draft = load_draft(SpeculativeConfig.parse(spec), model, model, "float32")
            out[name] = {rows: timed(draft, rows) for rows in (1, 4, 16)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--proposers", default="none,ngram,self-int8,layers-12-int8,layers-20-int8")
    parser.add_argument("--workloads", default="chat,grounded")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--parts", default="run,cost")
    parser.add_argument("--gguf-blocks", default="auto", choices=GGUF_BLOCKS_CHOICES,
                        help="the target's GGUF matrices as served (auto: kept as blocks on CPU) or expanded")
    args = parser.parse_args()
    proposers = args.proposers.split(",")
    keep = keep_gguf_blocks(args.gguf_blocks, "float32", 1)
    model = load_model(args.model, keep_blocks=keep)
    print(f"target: {args.model}, GGUF matrices {'kept as blocks' if keep else 'expanded to float32'}")
    parts = args.parts.split(",")
    costs = cost_model(model, proposers, args.k) if "cost" in parts else None
    if "run" in parts:
        workloads, batches = args.workloads.split(","), [int(b) for b in args.batches.split(",")]
        results = {name: run_proposer(model, PROPOSERS[name], args.k, workloads, batches, args.new_tokens)
                   for name in proposers}
        base = results.get("none")
        print(f"{'proposer':16} {'workload':9} {'batch':>5} {'tok/s':>7} {'ratio':>6} {'model':>6} {'accept':>7} "
              f"{'mean acc':>8} {'tok/step':>8} {'verified':>8} same")
        nan = float("nan")
        for name, rows in results.items():
            for (workload, batch), row in rows.items():
                ref = base[(workload, batch)] if base else None
                ratio = row["tok_s"] / ref["tok_s"] if ref else nan
                model_ratio = (predicted_ratio(row, costs, name, args.k)
                               if costs and batch == 1 and "tokens_per_step" in row else nan)
                same = "yes" if ref is None or ref["tokens"] == row["tokens"] else "NO"
                print(f"{name:16} {workload:9} {batch:5d} {row['tok_s']:7.1f} {ratio:6.2f} {model_ratio:6.2f} "
                      f"{row.get('acceptance', nan):7.2f} {row.get('mean_accepted', nan):8.2f} "
                      f"{row.get('tokens_per_step', nan):8.2f} {row.get('verify_share', nan):8.2f} {same}")
    if costs:
        print(json.dumps({"cost_ms": costs}, indent=1))


if __name__ == "__main__":
    main()
