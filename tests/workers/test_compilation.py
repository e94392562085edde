"""After warm-up, serving traffic never compiles: every shape falls into a precompiled bucket."""

from __future__ import annotations

import asyncio
import threading

import jax
import numpy as np
import pytest

from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.async_engine import AsyncEngine
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm import LLM
from raylm.workers.engine.llm_engine import LLMEngine
from raylm.workers.runner.warmup_order import FIRST_PACKED_TOKENS
from tests.checkpoints import build_tiny_checkpoint


def test_no_compilation_after_warmup(tmp_path, compilations):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    llm = LLM(load_model(path), max_model_len=256, num_kv_blocks=120, max_num_seqs=8,
              max_num_batched_tokens=64, warmup=True)
    assert compilations, "warm-up compiled nothing?"
    compilations.clear()

    rng = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rng.randint(3, 320, size=n).tolist()} for n in (1, 5, 17, 60, 130, 200, 31, 2)]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, ignore_eos=True)
    llm.generate(prompts, [greedy, sampled] * 4)
    llm.generate(prompts[:3], SamplingParams(n=3, max_tokens=10, temperature=0.7, ignore_eos=True))
    llm.generate(prompts[:1], greedy)  # 1-row decode bucket
    llm.generate(prompts[1:3], greedy)  # 2-row decode bucket
    assert compilations == []


def test_a_served_engine_serves_while_it_warms_up_and_then_never_compiles(tiny_gqa_model, compilations):
    """AsyncEngine compiles what a request alone takes before it is built, serves at once, and
    compiles the rest while idle; the tokens are those of an engine that never warmed up."""
    args = dict(max_model_len=256, num_kv_blocks=120, max_num_seqs=8, max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (1, 5, 17, 60, 130, 31)]
    expected = [o.outputs[0].token_ids for o in LLM(tiny_gqa_model, **args).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]

    async def generate(engine, indices):
        streams = [[o async for o in engine.generate(prompts[i], greedy, f"r{i}")] for i in indices]
        return [stream[-1].outputs[0].token_ids for stream in streams]

    async def main():
        # Built as AsyncEngine.from_model builds it, counting what is left before its thread starts.
        llm_engine = LLMEngine(tiny_gqa_model, EngineArgs(warmup=True, **args), background_warmup=True)
        left = len(llm_engine.warmup_pending)
        engine = AsyncEngine(llm_engine)
        try:
            first = await generate(engine, [0])  # while the rest compile, between its steps
            for _ in range(6000):  # up to 5 minutes on a loaded machine
                if (await engine.stats()).warmup_programs_left == 0:
                    break
                await asyncio.sleep(0.05)
            compilations.clear()
            rest = await asyncio.gather(*(generate(engine, [i]) for i in range(1, len(prompts))))
            return left, first + [ids for [ids] in rest], list(compilations)
        finally:
            engine.shutdown()

    left, outputs, compiled = asyncio.run(main())
    assert left > 0, "nothing was left to compile in the background"
    assert outputs == expected
    assert compiled == []


def test_a_served_engine_is_built_to_warm_up_in_the_background(monkeypatch):
    """Replicas build their engine with ``AsyncEngine.from_model``: it must ask for the background
    warm-up, or a replica compiles every bucket before serving (the replacement-time goal)."""
    from raylm.workers.engine import async_engine, llm_engine

    built = {}

    def make_engine(model, background_warmup=False, **engine_args):
        built.update(model=model, background_warmup=background_warmup, **engine_args)
        raise RuntimeError("stop before any engine is built")

    monkeypatch.setattr(llm_engine, "make_engine", make_engine)  # (from_model imports it when called)
    with pytest.raises(RuntimeError, match="stop before"):
        async_engine.AsyncEngine.from_model("some-model", max_num_seqs=4)
    assert built == {"model": "some-model", "background_warmup": True, "max_num_seqs": 4}


def test_a_warming_engine_runs_long_prompts_in_the_chunks_it_has_compiled(tiny_gqa_model, compilations):
    """Until its other prompt programs are compiled, a served engine holds prompt chunks to the
    packed bucket it has: a long prompt and a short one compile nothing and get an unwarmed
    engine's tokens; once the warm-up has compiled the rest, a prompt goes in one chunk again."""
    args = dict(max_model_len=512, num_kv_blocks=120, max_num_seqs=8, max_num_batched_tokens=256,
                enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = np.random.RandomState(2).randint(3, 320, size=200).tolist()
    short = prompt[:10]
    [alone, short_alone] = LLM(tiny_gqa_model, **args).generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": short}], greedy)

    engine = LLMEngine(tiny_gqa_model, EngineArgs(warmup=True, **args), background_warmup=True)
    assert engine.scheduler.chunk_cap == FIRST_PACKED_TOKENS
    assert engine.runner.packed_unavailable == {16, 32, 128, 256}
    packed = [dims for kind, dims in engine.warmup_pending if kind == "packed"]
    assert packed == [(128,), (256,), (16,), (32,)], "larger chunks compile first, then the smaller ones"
    assert engine.warmup_pending[:2] == [("packed", (128,)), ("packed", (256,))]
    chunks: list[list[int]] = []
    execute = engine.runner.execute

    def recording(plan):
        chunks.append([c.num_tokens for c in plan.prefills])
        return execute(plan)

    engine.runner.execute = recording

    def generate(request_id: str, prompt: list[int] = prompt) -> tuple[list[int], list[bool]]:
        engine.add_request(request_id, prompt, greedy)
        waits, final = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
            waits.append(engine.chunks_wait_for_compile)
        return list(final.outputs[0].token_ids), waits

    compilations.clear()
    tokens, waits = generate("warming")
    assert [c for c in chunks if c] == [[64], [64], [64], [8]]  # the 8 tokens padded to 64, not 16
    assert waits[:3] == [True, True, True] and not any(waits[3:])
    short_tokens, _ = generate("short", short)
    assert compilations == []
    assert tokens == list(alone.outputs[0].token_ids)
    assert short_tokens == list(short_alone.outputs[0].token_ids)

    while engine.warmup_pending:
        engine.warm_up_next()
    assert engine.runner.packed_unavailable == frozenset() and engine.scheduler.chunk_cap is None
    chunks.clear()
    tokens, waits = generate("warm")
    assert [c for c in chunks if c] == [[200]] and not any(waits)
    assert tokens == list(alone.outputs[0].token_ids)


def test_an_engine_thread_that_warms_up_compiles_the_chunk_a_running_prompt_waits_for(tiny_gqa_model):
    """A runner that cannot compile beside its steps (a multi-host leader, a pipeline) warms up on
    the engine thread. Under steady load that never finds the engine idle: a step that held a
    prompt to the compiled chunks is followed by the next program's compile, requests running."""
    args = dict(max_model_len=512, num_kv_blocks=120, max_num_seqs=8, max_num_batched_tokens=256)
    llm_engine = LLMEngine(tiny_gqa_model, EngineArgs(warmup=True, **args), background_warmup=True)
    llm_engine.runner.compiles_off_thread = False
    compiled = []  # what compiled while a request ran
    warm_up_next = llm_engine.warm_up_next

    def only_under_load() -> None:  # idle, compile nothing (the loop comes back at once)
        if llm_engine.has_unfinished_requests():
            compiled.append(llm_engine.warmup_pending[0])
            warm_up_next()

    llm_engine.warm_up_next = only_under_load
    prompt = np.random.RandomState(3).randint(3, 320, size=200).tolist()

    async def main():
        engine = AsyncEngine(llm_engine)
        try:
            return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0), "r")]
        finally:
            engine.shutdown()

    outputs = asyncio.run(main())
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert compiled == [("packed", (128,)), ("packed", (256,))]  # after the 64- and the 128-token chunk


@pytest.fixture
def compiling_threads():
    """The thread each program was compiled (or read back from the compilation cache) on."""
    threads: list[str] = []

    def listener(name: str, *_args, **_kwargs) -> None:
        if name in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            threads.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield threads
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _serve_while_warming(llm_engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Each prompt's tokens, served one after another by an AsyncEngine over ``llm_engine`` from
    the moment it is built, then once more after its warm-up is done; and the programs it had left."""

    async def generate(engine, indices):
        return [[o async for o in engine.generate(prompts[i], params, f"r{i}-{n}")][-1].outputs[0].token_ids
                for n, i in enumerate(indices)]

    async def main():
        left = len(llm_engine.warmup_pending)
        engine = AsyncEngine(llm_engine)
        try:
            during = await generate(engine, range(len(prompts)))
            for _ in range(6000):  # up to 5 minutes on a loaded machine
                if (await engine.stats()).warmup_programs_left == 0:
                    break
                await asyncio.sleep(0.05)
            return left, during, await generate(engine, range(len(prompts)))
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_a_served_engine_compiles_its_warm_up_on_a_thread_beside_the_steps(tiny_gqa_model, compiling_threads):
    """The engine thread steps requests while another thread compiles what the warm-up left: it
    compiles nothing itself (each program the compile thread made is the one its launch meets),
    long prompts run in the chunks compiled so far, and the tokens are an unwarmed engine's."""
    args = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (200, 7, 130, 64, 1)]
    expected = [o.outputs[0].token_ids for o in LLM(tiny_gqa_model, num_kv_blocks=120, **args).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]

    # A pool of its own size: programs no other engine in this process compiled.
    llm_engine = LLMEngine(tiny_gqa_model, EngineArgs(warmup=True, num_kv_blocks=117, **args), background_warmup=True)
    compiling_threads.clear()
    left, during, after = _serve_while_warming(llm_engine, prompts, greedy)
    assert left > 0 and llm_engine.warmup_pending == []
    assert during == expected and after == expected
    assert len(compiling_threads) >= left and set(compiling_threads) == {"raylm-compile"}


def test_a_failed_background_compile_ends_the_warm_up_and_the_engine_serves_on(tiny_gqa_model, monkeypatch,
                                                                               caplog):
    """A compile that fails on the compile thread is logged and ends the warm-up: prompt chunks
    are no longer held to the compiled buckets, what was left compiles on first use, and requests
    get an unwarmed engine's tokens."""
    args = dict(max_model_len=512, num_kv_blocks=120, max_num_seqs=8, max_num_batched_tokens=256)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [np.random.RandomState(5).randint(3, 320, size=200).tolist()]
    expected = [o.outputs[0].token_ids for o in LLM(tiny_gqa_model, **args).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]
    llm_engine = LLMEngine(tiny_gqa_model, EngineArgs(warmup=True, **args), background_warmup=True)
    compile_one = llm_engine.runner.compile
    failing = llm_engine.warmup_pending[1]

    def compile_or_fail(num_scheduler_steps, shape):
        if shape == failing:
            raise RuntimeError("out of memory while compiling")
        compile_one(num_scheduler_steps, shape)

    monkeypatch.setattr(llm_engine.runner, "compile", compile_or_fail)
    _, during, after = _serve_while_warming(llm_engine, prompts, greedy)
    assert llm_engine.warmup_pending == [] and llm_engine.scheduler.chunk_cap is None
    assert llm_engine.runner.packed_unavailable == frozenset()
    assert during == expected and after == expected
    assert any("background warm-up failed" in r.getMessage() and r.exc_info for r in caplog.records)
