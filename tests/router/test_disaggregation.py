"""Prefill/decode disaggregation in the router, over scripted fake prefill and decode deployments.

Each path of the prefill hop is taken on purpose: the hop succeeds (the prompt goes to a prefill
replica as a prompt-only request marked to publish its KV, then to a decode replica marked to
load it, and the client sees the decode replica's stream and usage alone); the prefill replica
dies, errs, is overloaded or too slow (the decode replica computes the prompt instead, and the
fallback is counted by reason); the prefill replica refuses the request as invalid (400, no
decode); the client goes away during the prefill (the prefill call is cancelled, no decode call
is made). After each, the router holds nothing and every call ended exactly once.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from raylm.router.openai_service import OpenAIService
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk, InvalidRequestError
from tests.fake_worker import HANG, FakeWorker, chunk, fake_settings, ledger_problems, post_json

BODY = {"model": "m", "prompt": "Hello there, how are you", "max_tokens": 2, "temperature": 0.7}
PREFILL_OUTPUT = GenerateChunk("r", [ChoiceDelta(0, "PREFILL", [9], None, "length")], prompt_tokens=999,
                               num_cached_tokens=999, finished=True)


def decode_chunks(cached: int) -> list[GenerateChunk]:
    """What a decode replica streams: two tokens, ``cached`` of the prompt's tokens loaded."""
    return [GenerateChunk("r", [ChoiceDelta(0, "a", [1], None)], 6, cached, False),
            GenerateChunk("r", [ChoiceDelta(0, "b", [2], None, "length")], 6, cached, True)]


class DecodeWorker(FakeWorker):
    """The decode deployment; notes at each call how many prefill calls had been cancelled by then."""

    def __init__(self, script: list, prefill: FakeWorker):
        super().__init__(script)
        self.prefill = prefill
        self.prefill_cancels_seen: list[int] = []

    def remote(self, request):
        self.prefill_cancels_seen.append(sum(call.cancels for call in self.prefill.calls))
        return super().remote(request)


@pytest.fixture
def service(tokenizer):
    prefill = FakeWorker([PREFILL_OUTPUT])
    svc = OpenAIService(DecodeWorker(decode_chunks(cached=4), prefill),
                        fake_settings(queue_timeout_s=0.3, prefill_timeout_s=0.5), tokenizer, prefill_worker=prefill)
    svc.admission.set_capacity(4)
    svc.prefill_seconds, svc.fallbacks = [], []
    svc.metrics.prefill_seconds = svc.prefill_seconds.append
    svc.metrics.pd_fallback = svc.fallbacks.append
    return svc


def _prefill_worker(service: OpenAIService) -> FakeWorker:
    return service.prefill_hop.prefill_worker


def _assert_nothing_held(service: OpenAIService) -> None:
    problems = ledger_problems(service)
    for call in _prefill_worker(service).calls:
        if not (call.finished or call.cancels == 1):
            problems.append(f"prefill call finished={call.finished} cancelled {call.cancels} times")
    assert not problems, problems


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_is_prefilled_then_decoded_and_the_client_sees_the_decode(service, stream):
    answer = asyncio.run(post_json(service.asgi_app(), {**BODY, "stream": stream,
                                                        "stream_options": {"include_usage": True}} if stream else BODY))
    assert answer.status == 200, answer.body
    if stream:
        events = [json.loads(line[6:]) for line in answer.body.decode().split("\n\n")
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        usage = events[-1]["usage"]
    else:
        reply = json.loads(answer.body)
        text, usage = reply["choices"][0]["text"], reply["usage"]
    assert text == "ab"  # the prefill's token never reaches the client
    prompt_tokens = len(service.tokenizer.encode(BODY["prompt"]))
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 2  # the prompt counted once
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}  # as the decode replica loaded them

    (prefill,), (decode,) = _prefill_worker(service).requests, service.worker.requests
    assert prefill.prompt_token_ids == decode.prompt_token_ids and len(decode.prompt_token_ids) == prompt_tokens
    assert prefill.block_hashes == decode.block_hashes  # prefix-aware choice among prefill replicas
    assert prefill.request_id == decode.request_id and prefill.priority == decode.priority
    assert (prefill.params.max_tokens, prefill.params.temperature, prefill.params.n) == (1, 0.0, 1)
    assert (prefill.publish_kv, prefill.refresh_kv) == (True, False)
    assert (decode.params.max_tokens, decode.params.temperature) == (2, 0.7)  # the client's own
    assert (decode.publish_kv, decode.refresh_kv) == (False, True)
    assert len(service.prefill_seconds) == 1 and service.fallbacks == []
    _assert_nothing_held(service)


FAILED_PREFILLS = {
    "prefill replica died": ([RayActorError()], "overloaded"),
    "prefill replicas' queues full": ([BackPressureError(num_queued_requests=1, max_queued_requests=1)], "overloaded"),
    "prefill step failed": ([RuntimeError("boom")], "error"),
    "prefill replica shut down mid-prefill": (
        [GenerateChunk("r", [ChoiceDelta(0, "", [], None, "abort")], 3, 0, True)], "overloaded"),
    "prefill too slow": ([HANG], "timeout"),
}


@pytest.mark.parametrize("name", list(FAILED_PREFILLS))
def test_a_failed_prefill_falls_back_to_the_decode_replica_computing_the_prompt(service, name):
    script, reason = FAILED_PREFILLS[name]
    _prefill_worker(service).script = script
    answer = asyncio.run(post_json(service.asgi_app(), BODY))
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["choices"][0]["text"] == "ab"
    (decode,) = service.worker.requests
    assert not decode.refresh_kv and not decode.publish_kv  # nothing was published: it computes the prompt
    assert service.fallbacks == [reason] and service.prefill_seconds == []
    if reason == "timeout":  # the slow prefill is aborted (its blocks freed) before the decode starts
        assert service.worker.prefill_cancels_seen == [1]
    _assert_nothing_held(service)


def test_a_request_the_prefill_replica_refuses_is_answered_400_without_a_decode(service):
    _prefill_worker(service).script = [InvalidRequestError("prompt too long for the KV pool")]
    answer = asyncio.run(post_json(service.asgi_app(), BODY))
    assert answer.status == 400 and "prompt too long" in json.loads(answer.body)["error"]["message"]
    assert service.worker.calls == [] and service.fallbacks == []
    _assert_nothing_held(service)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_the_prefill_cancels_it_and_never_decodes(service, stream):
    _prefill_worker(service).script = [HANG]
    service.prefill_hop.timeout_s = 30.0
    asyncio.run(post_json(service.asgi_app(), {**BODY, "stream": stream}, disconnect_after_s=0.2))
    assert _prefill_worker(service).calls[0].cancels == 1
    assert service.worker.calls == [] and service.fallbacks == []
    _assert_nothing_held(service)


def test_each_prompt_of_a_request_has_its_own_prefill(service):
    answer = asyncio.run(post_json(service.asgi_app(), {**BODY, "prompt": ["one two three", "four five"]}))
    assert answer.status == 200, answer.body
    prefills, decodes = _prefill_worker(service).requests, service.worker.requests
    assert sorted(r.request_id for r in prefills) == sorted(r.request_id for r in decodes)
    assert len(decodes) == 2 and all(r.refresh_kv for r in decodes)
    by_id = {r.request_id: r.prompt_token_ids for r in prefills}
    assert all(by_id[r.request_id] == r.prompt_token_ids for r in decodes)
    _assert_nothing_held(service)


def test_embeddings_skip_the_prefill_hop(service):
    service.worker.script = [GenerateChunk("r", [], 3, 0, True, embedding=[0.5, 0.25])]
    answer = asyncio.run(post_json(service.asgi_app(), {"model": "m", "input": "Hello"}, path="/v1/embeddings"))
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["data"][0]["embedding"] == [0.5, 0.25]
    assert _prefill_worker(service).calls == [] and not service.worker.requests[0].refresh_kv
    _assert_nothing_held(service)


def test_without_a_prefill_deployment_requests_go_straight_to_the_workers(tokenizer):
    plain = OpenAIService(FakeWorker([chunk("a"), chunk("b", finished=True)]), fake_settings(), tokenizer)
    plain.admission.set_capacity(4)
    answer = asyncio.run(post_json(plain.asgi_app(), BODY))
    assert answer.status == 200 and plain.prefill_hop is None
    (request,) = plain.worker.requests
    assert not request.refresh_kv and not request.publish_kv
    assert not ledger_problems(plain)
