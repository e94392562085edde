"""Quantized weights and KV cache side by side with float32, in one process on the same machine.

For each variant on the bundled model (``float32``: the GGUF's matrices expanded to float32;
``gguf_blocks``: the same numbers from its Q4_1 / Q8_0 blocks kept as stored, what serving
does by default on CPU; ``+a8``: the same weights in the integer compute mode (activations
int8 per 32 inputs, model/kernels/int8_matmul.py); ``int8`` / ``fp8`` weights; ``int8_g32`` (a scale per 32 inputs);
``kv_int8`` / ``kv_fp8`` KV pools; ``int8+kv_int8`` both):

1. ``weight_bytes``: what the parameters hold (8-bit matrices and their scales as stored).
2. ``kv_blocks``: blocks the default KV budget (2 GiB on CPU) holds, and the largest batch of
   ``--prompt-len + --new-tokens``-token sequences that fits them.
3. Offline ``workers.LLM`` output tokens/s: one sequence (single stream), 16 and 64 at once
   (128-token prompts, 128 output tokens, EOS ignored, prefix caching off, timed after a
   first run compiled every program).
4. Greedy agreement with float32 on ``REFERENCE_PROMPTS`` (chat-templated, 32 tokens): how
   many continuations are identical (all 32 tokens, and the first 16), and at each first divergence float32's own margin
   between its top two tokens (a small margin = a near tie that any rounding can flip).
   Part ``logits`` (not run by default): the logit error against float32 over every prompt
   position of those prompts (max and mean absolute).
5. ``shapes``: one matmul of each bundled-model shape at 1/16/64 rows: float32 kernel,
   W8A16 (int8 weights widened in the kernel) and W8A8 (int8 x int8 -> int32 by XLA's dot
   with per-row dynamic activation scales), median ms: why the engine keeps W8A16.

    python -m raylm.benchmarks.quantization_bench [--variants float32,int8,...] [--parts ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from raylm.cache.kv_budget import blocks_for_budget
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.kv_pool import kv_pool_dtype
from raylm.model.kernels.dense import dense
from raylm.model.loaders.load import LoadedModel, load_model
from raylm.model.quantization.activations import with_int8_activations
from raylm.model.quantization.quant_array import quantize, weight_bytes
from raylm.model.runtime.buckets import cdiv
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

REFERENCE_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your steps.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the planets of the solar system?",
    "Write a Python function that reverses a string.",
    "How do vaccines work?",
    "Suggest a name for a pet goldfish.",
    "What is the difference between weather and climate?",
    "Describe the water cycle.",
    "Tell me a joke about computers.",
    "What should I pack for a weekend camping trip?",
    "Explain what a prime number is.",
    "Who wrote Pride and Prejudice?",
    "How can I improve my sleep?",
)
AGREEMENT_TOKENS = 32
FIRST_TOKENS = 16  # also counted: continuations whose first 16 tokens agree
# name -> (weight quantization, kv_cache_dtype, GGUF blocks kept, activation quantization)
VARIANTS: dict[str, tuple[str, str, bool, str]] = {
    "float32": ("none", "auto", False, "none"),
    "gguf_blocks": ("none", "auto", True, "none"),
    "gguf_blocks+a8": ("none", "auto", True, "int8"),  # the integer compute mode on the blocks
    "int8": ("int8", "auto", False, "none"),
    "int8_g32": ("int8_g32", "auto", False, "none"),
    "int8_g32+a8": ("int8_g32", "auto", False, "int8"),
    "fp8": ("fp8", "auto", False, "none"),
    "kv_int8": ("none", "int8", False, "none"),
    "kv_fp8": ("none", "fp8", False, "none"),
    "int8+kv_int8": ("int8", "int8", False, "none"),
}


def _prompts(model: LoadedModel, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(1000, model.config.vocab_size, size=length).tolist() for _ in range(count)]


def _throughput(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    # A short first run compiles this batch's programs.
    llm.generate(batch, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def greedy_continuations(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each reference prompt's greedy tokens and, per token, the top-2 logprobs."""
    tok = llm.engine.tokenizer
    batch = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}])} for p in REFERENCE_PROMPTS]
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params)]


def agreement(reference: list, other: list) -> dict[str, Any]:
    """Identical continuations (all tokens, and the first ``FIRST_TOKENS``), and float32's top-2
    margin where each other one first diverges."""
    margins, diverged = [], []
    for (ref_tokens, ref_logprobs), (tokens, _) in zip(reference, other):
        diverge = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        if diverge is not None:
            top = sorted(ref_logprobs[diverge].values(), reverse=True)
            margins.append(round(top[0] - top[1], 4))
            diverged.append(diverge)
    first = sum(1 for i in diverged if i < FIRST_TOKENS)
    return {"identical": len(reference) - len(margins), f"identical_first_{FIRST_TOKENS}": len(reference) - first,
            "of": len(reference), "divergence_margins": margins}


def prompt_logits(model: LoadedModel, activation_quantization: str) -> list[np.ndarray]:
    """Each chat-templated reference prompt's logits at every position, ``[len, V]`` (the
    single-sequence reference loop, on the marked weights in the integer mode)."""
    params = with_int8_activations(model.params, model.name) if activation_quantization == "int8" else model.params
    generator = SingleSequenceGenerator(model.config, params)
    tok = model.tokenizer
    return [generator.prompt_logits(tok.encode_chat([{"role": "user", "content": p}])) for p in REFERENCE_PROMPTS]


def logit_error(reference: list[np.ndarray], other: list[np.ndarray]) -> dict[str, float]:
    """Max and mean absolute logit difference over every prompt position, and the max relative
    to the reference's largest logit."""
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(reference, other)])
    largest = max(float(np.abs(a).max()) for a in reference)
    return {"max_abs": round(float(diffs.max()), 4), "mean_abs": round(float(diffs.mean()), 5),
            "max_rel_to_max_logit": round(float(diffs.max()) / largest, 4)}


def bench_variant(args: argparse.Namespace, variant: str, reference: list | None,
                  reference_logits: list | None) -> tuple[dict[str, Any], list, list]:
    quantization, kv_cache_dtype, keep_blocks, activations = VARIANTS[variant]
    model = load_model(args.model, "float32", quantization, keep_blocks)
    row: dict[str, Any] = {"weight_bytes": weight_bytes(model.params)}
    c = model.config
    blocks = blocks_for_budget(c, 16, kv_pool_dtype(kv_cache_dtype, jnp.float32), None, 0.8)
    per_seq = cdiv(args.prompt_len + args.new_tokens, 16)
    row["kv_blocks"], row["max_batch_in_kv_budget"] = blocks, (blocks - 1) // per_seq
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=2048, enable_prefix_caching=False,
              max_num_seqs=64, max_model_len=1024, seed=0, activation_quantization=activations)
    if "throughput" in args.parts:
        for count in (1, 16, 64):
            prompts = _prompts(model, count, args.prompt_len)
            row[f"out_tok_s_{count}"] = round(_throughput(llm, prompts, args.new_tokens), 1)
    continuations = greedy_continuations(llm) if "agreement" in args.parts else []
    if reference is not None and continuations:
        row["greedy_vs_float32"] = agreement(reference, continuations)
    logits = prompt_logits(model, activations) if "logits" in args.parts else []
    if reference_logits and logits:
        row["logits_vs_float32"] = logit_error(reference_logits, logits)
    del llm, model
    gc.collect()
    return row, continuations, logits


def _median_ms(fn: Callable[[], jax.Array], repeats: int = 15) -> float:
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def _w8a8(x: jax.Array, w: Any) -> jax.Array:
    """int8 x int8 -> int32 dot with per-row dynamic activation scales (XLA's dot)."""
    x_scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / 127.0
    xq = jnp.round(x / x_scale).astype(jnp.int8)
    acc = jnp.einsum("mk,nk->mn", xq, w.q, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale * w.scale


def bench_shapes(model_name: str) -> dict[str, Any]:
    c = load_model(model_name).config
    shapes = {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }
    rng = np.random.default_rng(0)
    float_dense = jax.jit(lambda x, w: dense(x, w, kernel=True))
    w8a8 = jax.jit(_w8a8)
    rows: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32))
        q = quantize(w, "int8")
        for m in (1, 16, 64):
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            rows[f"{name} {n}x{k} rows={m}"] = {
                "f32_ms": _median_ms(lambda: float_dense(x, w)),
                "w8a16_ms": _median_ms(lambda: float_dense(x, q)),
                "w8a8_xla_ms": _median_ms(lambda: w8a8(x, q)),
            }
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--parts", default="throughput,agreement,shapes", help="also: logits")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    args.parts = set(args.parts.split(","))

    results: dict[str, Any] = {}
    reference = reference_logits = None
    variants = args.variants.split(",")
    if "float32" in variants:  # first: the others' greedy agreement is against it
        variants.remove("float32")
        variants.insert(0, "float32")
    for variant in variants:
        row, continuations, logits = bench_variant(args, variant, reference, reference_logits)
        if variant == "float32":
            reference, reference_logits = continuations, logits
        results[variant] = row
        print(json.dumps({variant: row}), flush=True)
    if "float32" in results:
        base = results["float32"]
        for variant, row in results.items():
            ratios = {k: round(row[k] / base[k], 2) for k in row if k.startswith("out_tok_s") and k in base}
            for key in ("weight_bytes", "kv_blocks"):
                ratios[key] = round(row[key] / base[key], 3)
            print(f"{variant} / float32: {json.dumps(ratios)}", flush=True)
    if "shapes" in args.parts:
        print(json.dumps({"shapes": bench_shapes(args.model)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
