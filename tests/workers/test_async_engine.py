"""AsyncEngine: streaming deltas, concurrent requests, abort frees blocks at once."""

from __future__ import annotations

import asyncio

import pytest

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.async_engine import AsyncEngine
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm import LLM
from raylm.workers.engine.llm_engine import LLMEngine


@pytest.fixture
def engine(tiny_gqa_model):
    engine = AsyncEngine(LLMEngine(tiny_gqa_model, EngineArgs(max_model_len=512, num_kv_blocks=200, max_num_seqs=8)))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _wait_for_no_used_blocks(engine, timeout=10.0):
    for _ in range(int(timeout / 0.05)):
        stats = await engine.stats()
        if stats.pool.num_used_blocks == 0 and stats.running == 0:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still in use: {stats}")


def test_streams_equal_offline_results(tiny_gqa_model, engine):
    prompts = [[5, 6, 7], list(range(3, 60)), [9] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    offline = LLM(tiny_gqa_model, max_model_len=512, num_kv_blocks=200).generate(
        [{"prompt_token_ids": p} for p in prompts], params
    )

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))

    for stream, reference in zip(asyncio.run(main()), offline):
        final = stream[-1].outputs[0]
        assert final.token_ids == reference.outputs[0].token_ids and stream[-1].finished
        assert sum((o.outputs[0].token_ids_delta for o in stream), []) == final.token_ids
        assert "".join(o.outputs[0].text_delta for o in stream) == final.text
        assert not any(o.finished for o in stream[:-1])


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        seen = 0
        async for _ in engine.generate(list(range(3, 100)), params, "long"):
            seen += 1
            if seen == 3:
                break
        return await _wait_for_no_used_blocks(engine)

    stats = asyncio.run(main())
    assert stats.generation_tokens < 400


def test_abort_by_id_from_another_task(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        outputs = []

        async def consume():
            async for out in engine.generate([7, 8, 9], params, "victim"):
                outputs.append(out)

        task = asyncio.create_task(consume())
        while len(outputs) < 2:
            await asyncio.sleep(0.01)
        await engine.abort("victim")
        await task
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        return await _wait_for_no_used_blocks(engine)

    asyncio.run(main())


def test_bad_request_raises_in_the_caller(engine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, [1, 10**9], SamplingParams(max_tokens=3), "bad")
        # The engine keeps serving afterwards.
        out = await _collect(engine, [5, 6], SamplingParams(max_tokens=3, temperature=0), "good")
        assert len(out[-1].outputs[0].token_ids) == 3

    asyncio.run(main())
