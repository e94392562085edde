"""Offline engine benchmark (``raylm bench --offline``): numbers side by side in one process.

1. Throughput: 64 requests of ~128 prompt tokens, 128 output tokens each (EOS ignored), all
   submitted at once: output tokens/s of the engine vs the single-request reference loop
   (and optionally HF transformers padded-batch ``generate`` and a llama.cpp server).
2. Single stream: time per output token of one request.
3. Shared prefix: 64 requests = one 512-token prefix + 32 unique tokens, 32 output tokens:
   prompt tokens actually computed and wall time with prefix caching on vs off.
4. KV memory: tokens stored / capacity of the allocated blocks at peak usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from typing import Any

import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import LoadedModel, load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import LLMEngine


def _prompts(model: LoadedModel, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    # Ordinary-token ids (skip the special/control range at the start of the vocab).
    return [rng.randint(1000, model.config.vocab_size, size=length).tolist() for _ in range(count)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
               concurrency: int | None = None) -> dict[str, float]:
    """Step ``prompts`` to completion; returns wall time, tokens and peak KV use. All are submitted
    at once, or with ``concurrency`` that many are in flight and each finished request is
    replaced before the next step (what a closed-loop client does, minus its round trip)."""
    waiting = list(enumerate(prompts))
    in_flight = 0

    def submit() -> None:
        nonlocal in_flight
        while waiting and (concurrency is None or in_flight < concurrency):
            i, prompt = waiting.pop(0)
            engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
            in_flight += 1

    prompt_before = engine.scheduler.num_prompt_tokens
    out_tokens, peak_blocks, peak_fill = 0, 0, 1.0
    start = time.perf_counter()
    submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
                in_flight -= 1
        used = engine.pool.num_used_blocks
        if used > peak_blocks:
            stored = sum(s.num_computed_tokens for s in engine.scheduler.running)
            peak_blocks, peak_fill = used, stored / (used * engine.pool.block_size)
        submit()
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tok_s": out_tokens / wall,
        "prompt_tokens_computed": engine.scheduler.num_prompt_tokens - prompt_before,
        "peak_kv_fill": peak_fill,
    }


def bench_reference_loop(model: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of the one-request-at-a-time loop (sequential, so a few requests suffice)."""
    gen = SingleSequenceGenerator(model.config, model.params)
    list(gen.generate(prompts[0], 2))  # compile
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += sum(1 for _ in gen.generate(prompt, new_tokens))
    return tokens / (time.perf_counter() - start)


def bench_hf_padded_batch(model: LoadedModel, prompts: list[list[int]], new_tokens: int) -> float:
    """HF transformers (torch CPU, float32) padded-batch greedy generate on the same GGUF weights."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.path.parent, gguf_file=model.path.name, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / wall


def bench_llama_server(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of a llama.cpp server given the same token-id prompts, all at once."""
    import httpx

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        r = await client.post(f"{url}/completion", json={
            "prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False,
        })
        r.raise_for_status()
        return r.json()["tokens_predicted"]

    async def main() -> float:
        async with httpx.AsyncClient(timeout=None) as client:
            await one(client, prompts[0][:8])
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(client, p) for p in prompts))
            return sum(counts) / (time.perf_counter() - start)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--hf", action="store_true", help="also run HF transformers padded-batch generate")
    parser.add_argument("--llama-server", default=None, help="URL of a llama.cpp server to drive the same way")
    args = parser.parse_args(argv)

    rows: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes.split(","):
        model = load_model(args.model, dtype)
        engine_args = EngineArgs(
            dtype=dtype, max_model_len=1024, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_scheduler_steps=args.num_scheduler_steps,
            num_kv_blocks=64 * 48 + 1,
        )
        prompts = _prompts(model, args.requests, args.prompt_len, 0)
        greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        engine = LLMEngine(model, engine_args)
        run_engine(engine, _prompts(model, args.requests, args.prompt_len, 1), greedy)  # compile the buckets
        r: dict[str, Any] = {"throughput": run_engine(engine, prompts, greedy)}
        r["single_stream"] = run_engine(engine, prompts[:1], greedy)
        r["reference_tok_s"] = bench_reference_loop(model, prompts[:2], args.new_tokens)
        shared, other = _prompts(model, 2, 512, 2)
        tails = _prompts(model, 64, 32, 3)
        short = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        for caching in (True, False):
            e = LLMEngine(model, dataclasses.replace(engine_args, enable_prefix_caching=caching))
            run_engine(e, [other + t for t in tails], short)  # compile; caches a different prefix
            r[f"shared_prefix_{'on' if caching else 'off'}"] = run_engine(e, [shared + t for t in tails], short)
        if args.hf:
            r["hf_tok_s"] = bench_hf_padded_batch(model, prompts, args.new_tokens) if dtype == "float32" else None
        if args.llama_server:
            r["llama_server_tok_s"] = bench_llama_server(args.llama_server, prompts, args.new_tokens)
        rows[dtype] = r
        _report(dtype, r, args)


def _report(dtype: str, r: dict[str, Any], args: argparse.Namespace) -> None:
    t, s = r["throughput"], r["single_stream"]
    print(f"\n== {dtype}: {args.requests} requests x {args.prompt_len} prompt + {args.new_tokens} output tokens ==")
    print(f"engine throughput         {t['tok_s']:9.1f} output tok/s  ({t['wall_s']:.1f} s)")
    print(f"reference loop            {r['reference_tok_s']:9.1f} output tok/s  -> engine is "
          f"{t['tok_s'] / r['reference_tok_s']:.1f}x")
    if r.get("hf_tok_s"):
        print(f"HF transformers padded    {r['hf_tok_s']:9.1f} output tok/s  -> engine is {t['tok_s'] / r['hf_tok_s']:.2f}x")
    if r.get("llama_server_tok_s"):
        print(f"llama-server              {r['llama_server_tok_s']:9.1f} output tok/s  -> engine is "
              f"{t['tok_s'] / r['llama_server_tok_s']:.2f}x")
    print(f"single stream             {1000 * s['wall_s'] / s['output_tokens']:9.2f} ms/token "
          f"({s['tok_s']:.1f} tok/s, incl. prefill)")
    on, off = r["shared_prefix_on"], r["shared_prefix_off"]
    print(f"shared prefix (64 x 512+32, 32 out): prompt tokens computed {on['prompt_tokens_computed']} with caching "
          f"vs {off['prompt_tokens_computed']} without; wall {on['wall_s']:.2f} s vs {off['wall_s']:.2f} s "
          f"({off['wall_s'] / on['wall_s']:.2f}x)")
    print(f"KV fill at peak           {100 * t['peak_kv_fill']:9.1f} % of allocated block capacity")


if __name__ == "__main__":
    main()
