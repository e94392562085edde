"""KV offload tiers on the bundled model: issue 67's figures that need no Serve deployment.

Parts (``--parts``, all but ``cross-node`` by default), each a same-run comparison:

* ``cluster``: two replicas (engines) in this process on a local Ray cluster the script starts,
  both with the cluster tier. Replica A computes one request with a ``--prefix-tokens`` prefix and
  publishes it (``flush_kv_publish``); replica B sees it (``refresh_kv_tiers``); then
  ``--requests`` requests with that prefix and distinct short suffixes arrive at B at once.
  Against the same burst on a third engine without offload. TTFT of a request: the moment
  ``LLMEngine.step`` returns its first token minus its ``RequestOutput.arrival_time`` (the engine's
  stamp at ``add_request``), all requests added before the first step.
* ``conversations``: ``--conversations`` chats of ``--turns`` turns (a shared system prompt and a
  per-chat document, then per turn the previous answer and a short user message appended), all
  chats' turn t sent at once, on a pool sized so the chats' distinct context is ``--overflow``
  times the pool; host tier against none: prompt tokens computed (``EngineStats.prompt_tokens``)
  and output tokens/s over the whole run.
* ``restart``: an engine with the disk tier computes the prefix and closes; a new engine on the
  same directory serves one request on it, against a new engine without the disk tier (a cold
  restart). TTFT as above, and each engine's construction time. The files are fresh in the page
  cache: a restart after a reboot also reads the disk.
* ``transfer``: the cluster tier alone, same node: ``--transfer-blocks`` blocks of the engine's
  real layout published by one ``ClusterTier`` and read by another (zero-copy views of the object
  store, then also copied out, as the connector does into the host tier), in GB/s. The
  ``cluster`` part adds the rate B's loads ran at inside the engine (``TierStats``).
* ``cross-node``: runs ``tests/kv_cluster_scenario.py`` (a checkout only: two fake nodes, 16
  blocks of 1 MiB) and prints its cross-node and same-node fetch rates.

Outputs are checked identical with and without a tier (greedy). Prints one JSON line per part,
then a table of the figures against the issue's targets.

    python -m raylm.benchmarks.kv_offload [--parts cluster,conversations,restart,transfer]
        [--prefix-tokens 2800] [--requests 16] [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import LoadedModel, load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

DEFAULT_PARTS = ("cluster", "conversations", "restart", "transfer")
ALL_PARTS = (*DEFAULT_PARTS, "cross-node")
BLOCK_SIZE = 16
WORDS = ("the replica keeps every block of keys and values it computed for a prompt in its pool while "
         "memory lasts and a tier beyond the pool holds what was evicted so a later request loads "
         "instead of computing section report figure table model cluster node object store disk "
         "restart checksum directory actor transfer budget step token prefix suffix chat turn answer "
         "question document river mountain history engine kernel memory cache latency").split()
_request_ids = itertools.count()


def document(model: LoadedModel, num_tokens: int, seed: int, first: bool = True) -> list[int]:
    """``num_tokens`` token ids of a deterministic text of plain words (a BOS first if ``first``)."""
    rng = np.random.RandomState(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        text = " ".join(rng.choice(WORDS, size=64)) + ". "
        ids += model.tokenizer.encode(text, add_special_tokens=first and not ids)
    return ids[:num_tokens]


def suffix(model: LoadedModel, i: int) -> list[int]:
    return model.tokenizer.encode(f"\nQuestion {i}: what does part {i} of the report say?\nAnswer:",
                                  add_special_tokens=False)


def timed_burst(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Add all ``prompts`` to the engine, step until done; each request's TTFT (s) and tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"kv-bench-{next(_request_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = now - out.arrival_time
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [ttft[i] for i in ids], [tokens[i] for i in ids]


def _tier(llm: LLM, name: str):
    return next(t for t in llm.engine.stats().kv_offload if t.tier == name)


def _ttft_figures(ttft: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(ttft), "p50_s": statistics.median(ttft), "max_s": max(ttft)}


def _close(*llms: LLM) -> None:
    for llm in llms:
        llm.engine.close()
    gc.collect()


def cross_replica_prefix(model: LoadedModel, prefix_tokens: int, requests: int, num_kv_blocks: int | None,
                         cluster_bytes: int, warmup: bool = True) -> dict[str, Any]:
    """Part ``cluster`` (Ray must be initialized)."""
    prefix, warm = document(model, prefix_tokens, seed=0), document(model, prefix_tokens, seed=10)
    prompts = [prefix + suffix(model, i) for i in range(requests)]
    offload = {"cluster_bytes": cluster_bytes}
    a = LLM(model, num_kv_blocks=num_kv_blocks, kv_offload=offload, warmup=warmup)
    for doc in (warm, prefix):
        timed_burst(a, [doc + suffix(model, -1)], 1)
    a.engine.flush_kv_publish(120)
    published = _tier(a, "cluster").stored
    b = LLM(model, num_kv_blocks=num_kv_blocks, kv_offload=offload, warmup=warmup)
    b.engine.refresh_kv_tiers(60)
    plain = LLM(model, num_kv_blocks=num_kv_blocks, warmup=warmup)
    # The same burst on another prefix first (B loads it too): every program both engines need is compiled.
    for llm in (plain, b):
        timed_burst(llm, [warm + suffix(model, i) for i in range(requests)], 4)
    before = {id(llm): (llm.engine.stats().prompt_tokens, llm.engine.scheduler.loads.num_loaded_tokens
                        if llm.engine.kv_connector else 0) for llm in (plain, b)}
    without, expected = timed_burst(plain, prompts, 4)
    with_tier, tokens = timed_burst(b, prompts, 4)
    cluster = _tier(b, "cluster")
    load_seconds = sum(cluster.recent_load_seconds)
    result = {
        "part": "cluster", "prefix_tokens": len(prefix), "requests": requests,
        "pool_blocks": b.engine.stats().pool.num_usable_blocks,
        "published_blocks": published, "cluster_hits": cluster.hits, "cluster_loads": cluster.loads,
        "loaded_tokens": b.engine.scheduler.loads.num_loaded_tokens - before[id(b)][1],
        "prompt_tokens": {"with": b.engine.stats().prompt_tokens - before[id(b)][0],
                          "without": plain.engine.stats().prompt_tokens - before[id(plain)][0]},
        "ttft_with": _ttft_figures(with_tier), "ttft_without": _ttft_figures(without),
        "ttft_ratio_mean": statistics.fmean(with_tier) / statistics.fmean(without),
        "ttft_ratio_p50": statistics.median(with_tier) / statistics.median(without),
        # what B's loads read, over the time its loader spent reading (the last RECENT_LOADS loads)
        "engine_load_gb_s": cluster.load_bytes / load_seconds / 1e9 if load_seconds and cluster.loads <= 256 else None,
        "errors": cluster.errors, "same_tokens": tokens == expected,
    }
    _close(a, b, plain)
    return result


def conversation_plan(model: LoadedModel, conversations: int, turns: int, system_tokens: int, doc_tokens: int,
                      answer_tokens: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each chat's first prompt (the shared system prompt, its document) and its later user messages."""
    system = document(model, system_tokens, seed=1)
    firsts = [system + document(model, doc_tokens, seed=100 + i, first=False) for i in range(conversations)]
    follow_ups = [[model.tokenizer.encode(f"\nUser: and what about point {t} of document {i}?\nAssistant:",
                                          add_special_tokens=False) for t in range(1, turns)]
                  for i in range(conversations)]
    return firsts, follow_ups


def pool_for_overflow(firsts: list[list[int]], follow_ups: list[list[list[int]]], system_tokens: int,
                      answer_tokens: int, overflow: float) -> tuple[int, int]:
    """(pool blocks, blocks of the chats' distinct context at their last turn): the pool is the
    context over ``overflow``, but holds at least the longest chat and a block to grow in."""
    last = [len(f) + sum(map(len, fs)) + len(fs) * answer_tokens for f, fs in zip(firsts, follow_ups)]
    shared = system_tokens // BLOCK_SIZE
    live = shared + sum(-(-n // BLOCK_SIZE) - shared for n in last)
    longest = -(-(max(last) + answer_tokens) // BLOCK_SIZE)
    return max(int(live / overflow), longest + 1) + 1, live  # + 1: the reserved null block


def run_conversations(model: LoadedModel, firsts: list[list[int]], follow_ups: list[list[list[int]]],
                      warm_ups: list[list[int]], answer_tokens: int, num_kv_blocks: int, host_bytes: int | None,
                      warmup: bool) -> dict[str, Any]:
    offload = {"host_bytes": host_bytes} if host_bytes else None
    llm = LLM(model, num_kv_blocks=num_kv_blocks, kv_offload=offload, warmup=warmup)
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    # A first turn of other chats compiles the prompt and decode programs; the counters start after it.
    llm.generate([{"prompt_token_ids": w} for w in warm_ups], params)
    llm.engine.pool.reset_prefix_cache()
    before = llm.engine.stats()
    loaded_before = llm.engine.scheduler.loads.num_loaded_tokens if host_bytes else 0
    contexts = [list(f) for f in firsts]
    answers: list[list[list[int]]] = []
    start = time.perf_counter()
    for turn in range(len(follow_ups[0]) + 1):
        if turn:
            contexts = [c + a + fs[turn - 1] for c, a, fs in zip(contexts, answers[-1], follow_ups)]
        outputs = llm.generate([{"prompt_token_ids": c} for c in contexts], params)
        answers.append([list(o.outputs[0].token_ids) for o in outputs])
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    output_tokens = sum(len(a) for turn in answers for a in turn)
    result = {"prompt_tokens": stats.prompt_tokens - before.prompt_tokens, "output_tokens": output_tokens,
              "seconds": seconds, "tok_s": output_tokens / seconds,
              "preemptions": stats.num_preemptions - before.num_preemptions, "answers": answers,
              "loaded_tokens": (llm.engine.scheduler.loads.num_loaded_tokens if host_bytes else 0) - loaded_before}
    _close(llm)
    return result


def overflowing_conversations(model: LoadedModel, conversations: int, turns: int, system_tokens: int,
                              doc_tokens: int, answer_tokens: int, overflow: float, host_bytes: int,
                              warmup: bool = True) -> dict[str, Any]:
    """Part ``conversations``."""
    firsts, follow_ups = conversation_plan(model, conversations, turns, system_tokens, doc_tokens, answer_tokens)
    pool, live = pool_for_overflow(firsts, follow_ups, system_tokens, answer_tokens, overflow)
    system = firsts[0][:system_tokens]
    warm_ups = [system + document(model, doc_tokens, seed=200 + i, first=False) for i in range(conversations)]
    without = run_conversations(model, firsts, follow_ups, warm_ups, answer_tokens, pool, None, warmup)
    with_host = run_conversations(model, firsts, follow_ups, warm_ups, answer_tokens, pool, host_bytes, warmup)
    return {
        "part": "conversations", "conversations": conversations, "turns": turns, "pool_blocks": pool - 1,
        "live_blocks": live, "live_over_pool": live / (pool - 1),
        "with": {k: v for k, v in with_host.items() if k != "answers"},
        "without": {k: v for k, v in without.items() if k != "answers"},
        "prompt_tokens_ratio": with_host["prompt_tokens"] / without["prompt_tokens"],
        "tok_s_ratio": with_host["tok_s"] / without["tok_s"],
        "same_tokens": with_host["answers"] == without["answers"],
    }


def restart(model: LoadedModel, prefix_tokens: int, num_kv_blocks: int | None, disk_bytes: int,
            warmup: bool = True) -> dict[str, Any]:
    """Part ``restart``."""
    prefix, warm_up = document(model, prefix_tokens, seed=2), document(model, prefix_tokens, seed=12)
    directory = tempfile.mkdtemp(prefix="raylm-kv-bench-")
    try:
        disk = {"disk_path": directory, "disk_bytes": disk_bytes}
        first = LLM(model, num_kv_blocks=num_kv_blocks, kv_offload=disk, warmup=warmup)
        for doc in (warm_up, prefix):
            timed_burst(first, [doc + suffix(model, -1)], 1)
        first.engine.flush_kv_publish(120)
        stored = _tier(first, "disk").stored
        _close(first)
        del first
        prompt = [prefix + suffix(model, 0)]
        # Each restarted engine serves another prompt of the same length first (the disk engine
        # loads it), so the timed request runs compiled programs, as after a served warm-up.
        start = time.perf_counter()
        warm = LLM(model, num_kv_blocks=num_kv_blocks, kv_offload=disk, warmup=warmup)
        warm_build = time.perf_counter() - start
        timed_burst(warm, [warm_up + suffix(model, 0)], 4)
        (warm_ttft,), tokens = timed_burst(warm, prompt, 4)
        hits = _tier(warm, "disk").hits
        errors = _tier(warm, "disk").errors
        _close(warm)
        start = time.perf_counter()
        cold = LLM(model, num_kv_blocks=num_kv_blocks, warmup=warmup)
        cold_build = time.perf_counter() - start
        timed_burst(cold, [warm_up + suffix(model, 0)], 4)
        (cold_ttft,), expected = timed_burst(cold, prompt, 4)
        _close(cold)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"part": "restart", "prefix_tokens": len(prefix), "stored_blocks": stored, "disk_hits": hits,
            "errors": errors, "ttft_warm_s": warm_ttft, "ttft_cold_s": cold_ttft, "ttft_ratio": warm_ttft / cold_ttft,
            "build_warm_s": warm_build, "build_cold_s": cold_build, "same_tokens": tokens == expected}


def block_nbytes(model: LoadedModel) -> int:
    """Bytes of one block of ``model``'s KV in every layer, as the tiers store it."""
    llm = LLM(model, num_kv_blocks=4, kv_offload={"host_bytes": 1 << 20}, warmup=False)
    nbytes = llm.engine.pool_blocks.layout.nbytes
    _close(llm)
    return nbytes


def transfer(nbytes: int, num_blocks: int, rounds: int = 3) -> dict[str, Any]:
    """Part ``transfer`` (Ray must be initialized): best of ``rounds`` per direction."""
    from raylm.cache.offload.identity import namespace, tier_keys
    from raylm.cluster.kv_cluster_tier import ClusterTier

    total = nbytes * num_blocks
    publisher = ClusterTier(total * (rounds + 1))
    reader = ClusterTier(total * (rounds + 1))
    rng = np.random.RandomState(3)
    payloads = [rng.randint(0, 256, size=nbytes, dtype=np.uint8) for _ in range(num_blocks)]
    put_s, get_s, copy_s, equal = [], [], [], True
    for r in range(rounds):
        keys = tier_keys(namespace("kv-offload-bench", f"round={r}", str(time.time_ns())), list(range(num_blocks)))
        start = time.perf_counter()
        publisher.put(list(zip(keys, payloads)))
        put_s.append(time.perf_counter() - start)
        reader.refresh(60)
        start = time.perf_counter()
        got = reader.get(keys)
        get_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        copies = [np.array(p) for p in got if p is not None]
        copy_s.append(time.perf_counter() - start)
        equal = equal and len(copies) == num_blocks and all(np.array_equal(c, p) for c, p in zip(copies, payloads))
    errors = {**publisher.stats().errors, **reader.stats().errors}
    publisher.close()
    reader.close()
    return {"part": "transfer", "block_bytes": nbytes, "blocks": num_blocks, "bytes": total,
            "put_gb_s": total / min(put_s) / 1e9, "get_gb_s": total / min(get_s) / 1e9,
            "get_and_copy_gb_s": total / min(g + c for g, c in zip(get_s, copy_s)) / 1e9,
            "equal": equal, "errors": errors}


def cross_node() -> dict[str, Any]:
    """Part ``cross-node``: the checkout's two-node scenario, in its own process and cluster."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests" / "kv_cluster_scenario.py").exists():
        return {"part": "cross-node", "skipped": "tests/kv_cluster_scenario.py is not here (not a checkout)"}
    done = subprocess.run([sys.executable, "-m", "tests.kv_cluster_scenario"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    found = json.loads(lines[-1]) if lines else {"ok": False, "error": done.stderr[-2000:]}
    return {"part": "cross-node", "ok": found.get("ok"), "block_bytes": 1 << 20, "blocks": 16,
            "cross_node_gb_s": found.get("cross_node", {}).get("gb_per_s"),
            "same_node_gb_s": found.get("same_node", {}).get("gb_per_s"), "error": found.get("error")}


def start_ray(object_store_bytes: int) -> str:
    """A local Ray cluster of this process's own, under a private temp dir (no other cluster on
    the machine is joined); returns the temp dir to remove after ``ray.shutdown``."""
    temp_dir = tempfile.mkdtemp(prefix="rkvb", dir="/tmp")  # short: Ray's socket paths live under it
    os.environ["RAY_TMPDIR"] = temp_dir
    from raylm.cluster.local_ray import apply_local_ray_env

    apply_local_ray_env()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=object_store_bytes,
             _temp_dir=temp_dir)
    return temp_dir


def summary(results: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(figure, value, target) rows of the parts that ran."""
    rows = []
    for r in results:
        if r["part"] == "cluster":
            rows.append(("cross-replica prefix: TTFT on B, cluster tier / none (mean)",
                         f"{r['ttft_ratio_mean']:.3f} ({r['ttft_with']['mean_s']:.2f} s / "
                         f"{r['ttft_without']['mean_s']:.2f} s)", "<= 0.15"))
            rows.append(("  the same, p50", f"{r['ttft_ratio_p50']:.3f}", ""))
            if r["engine_load_gb_s"] is not None:
                rows.append(("  B's loads inside the engine, GB/s", f"{r['engine_load_gb_s']:.2f}", ""))
        elif r["part"] == "conversations":
            rows.append((f"conversations ({r['live_over_pool']:.1f}x the pool): prompt tokens, host / none",
                         f"{r['prompt_tokens_ratio']:.3f} ({r['with']['prompt_tokens']} / "
                         f"{r['without']['prompt_tokens']})", "<= 0.3"))
            rows.append(("  output tok/s, host / none", f"{r['tok_s_ratio']:.2f} ({r['with']['tok_s']:.1f} / "
                                                           f"{r['without']['tok_s']:.1f})", ">= 1.5"))
        elif r["part"] == "restart":
            rows.append(("restart: first TTFT, disk tier / cold", f"{r['ttft_ratio']:.3f} ({r['ttft_warm_s']:.2f} s"
                                                                  f" / {r['ttft_cold_s']:.2f} s)", "<= 0.2"))
        elif r["part"] == "transfer":
            rows.append(("cluster tier same node, GB/s: put / get (views) / get + copy",
                         f"{r['put_gb_s']:.2f} / {r['get_gb_s']:.2f} / {r['get_and_copy_gb_s']:.2f}", ""))
        elif r["part"] == "cross-node" and r.get("cross_node_gb_s") is not None:
            rows.append(("cluster tier across fake nodes / same node, GB/s (1 MiB blocks)",
                         f"{r['cross_node_gb_s']:.2f} / {r['same_node_gb_s']:.2f}", ""))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"any of {','.join(ALL_PARTS)}")
    parser.add_argument("--prefix-tokens", type=int, default=2800)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="pool of the cluster and restart parts (default: the engine's, from its memory budget)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=192)
    parser.add_argument("--doc-tokens", type=int, default=320)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--overflow", type=float, default=4.0, help="the chats' distinct context over the pool")
    parser.add_argument("--transfer-blocks", type=int, default=64)
    parser.add_argument("--tier-bytes", type=int, default=1 << 30, help="each tier's size")
    parser.add_argument("--no-warmup", action="store_true",
                        help="engines compile shapes as they meet them, not all at start-up (a smoke run)")
    args = parser.parse_args(argv)
    warmup = not args.no_warmup  # every engine compiles all its shape buckets at start-up
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(ALL_PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(ALL_PARTS)}")
    model = load_model(args.model)
    needs_ray = {"cluster", "transfer"}.intersection(parts)
    import_ray_here = False
    temp_dir = None
    if needs_ray:
        import ray

        import_ray_here = not ray.is_initialized()  # a caller's cluster (tests) is used as it is
        if import_ray_here:
            temp_dir = start_ray(3 * args.tier_bytes)
    results = []
    try:
        for part in parts:
            if part == "cluster":
                result = cross_replica_prefix(model, args.prefix_tokens, args.requests, args.num_kv_blocks,
                                              args.tier_bytes, warmup)
            elif part == "conversations":
                result = overflowing_conversations(model, args.conversations, args.turns, args.system_tokens,
                                                   args.doc_tokens, args.answer_tokens, args.overflow, args.tier_bytes,
                                                   warmup)
            elif part == "restart":
                result = restart(model, args.prefix_tokens, args.num_kv_blocks, args.tier_bytes, warmup)
            elif part == "transfer":
                result = transfer(block_nbytes(model), args.transfer_blocks)
            else:
                result = cross_node()
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        if import_ray_here:
            import ray

            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    rows = summary(results)
    width = max((len(r[0]) for r in rows), default=0)
    for figure, value, target in rows:
        print(f"{figure:{width}}  {value:28}  {target}")
    return results


if __name__ == "__main__":
    main()
