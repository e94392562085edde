"""The router refuses at once a prompt longer than the replicas' KV pools can ever admit, as the
replicas report it (``EngineStats.max_prompt_tokens``), and lets through what a replica whose
attention windows bound a sequence's blocks can serve however long (no Ray: a fake worker)."""

from __future__ import annotations

import asyncio
import json

import pytest

from raylm.cache.block_pool import PoolStats
from raylm.model.config.model_info import load_model_info
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.router.openai_service import OpenAIService
from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.wire.replica_protocol import RoutingReport
from tests.fake_worker import FakeWorker, chunk, fake_settings, post_json


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info(DEFAULT_MODEL).tokenizer


def _report(max_prompt_tokens: int | None) -> dict:
    pool = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                     prefix_queries=0, prefix_hits=0)
    stats = EngineStats(running=0, waiting=0, waiting_tokens=0, work_tokens=0, tokens_stored=0, token_capacity=0,
                        num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0, pool=pool,
                        max_prompt_tokens=max_prompt_tokens)
    return RoutingReport(stats, "node", []).as_dict()


def _status(service: OpenAIService, prompt_len: int) -> tuple[int, str | None]:
    body = {"model": "m", "prompt": [5] * prompt_len, "max_tokens": 2}
    answer = asyncio.run(post_json(service.asgi_app(), body))
    error = json.loads(answer.body).get("error") if answer.status != 200 else None
    return answer.status, error and error["code"]


def test_the_replicas_reported_prompt_limit_decides(tokenizer):
    service = OpenAIService(FakeWorker([chunk("a"), chunk("b", finished=True)]), fake_settings(), tokenizer)
    # A pool of 8 blocks of 16 tokens (127 prompt tokens and the first output's K/V) and a
    # replica whose windows bound what a sequence holds (no limit): the smaller limit counts.
    service.update_replicas({"a": _report(127), "b": _report(None)})
    assert _status(service, 127) == (200, None)
    assert _status(service, 128) == (400, "prompt_too_long_for_kv_cache")

    service.update_replicas({"b": _report(None)})  # a windowed model's pool: only the context limits
    assert _status(service, 400) == (200, None)
