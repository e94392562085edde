"""The official ``openai`` client against raylm on a real Ray cluster (two worker replicas)."""

from __future__ import annotations

import json

import httpx
import pytest

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import LLMEngine
from tests.serving import TEST_DEPLOY

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(raylm_app):
    return openai.OpenAI(base_url=f"{raylm_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_engine(bundled_model):
    """The engine in this process with the served engine settings: the reference output."""
    return LLMEngine(bundled_model, EngineArgs(**TEST_DEPLOY["engine"]))


def _offline_greedy(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    engine.add_request("ref", prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final.outputs[0].text, final.outputs[0].finish_reason


def test_models_list(client, raylm_app):
    models = client.models.list()
    assert [m.id for m in models.data] == [raylm_app.model]
    assert client.models.retrieve(raylm_app.model).id == raylm_app.model


def test_greedy_chat_equals_the_offline_engine(client, raylm_app, offline_engine, bundled_model):
    reply = client.chat.completions.create(model=raylm_app.model, messages=QUESTION, temperature=0, max_tokens=40)
    expected, finish = _offline_greedy(offline_engine, bundled_model.tokenizer.encode_chat(QUESTION), 40)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert "Paris" in expected
    assert choice.finish_reason == finish
    prompt_len = len(bundled_model.tokenizer.encode_chat(QUESTION))
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.total_tokens == prompt_len + reply.usage.completion_tokens
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == raylm_app.model


def test_streaming_chat_with_usage_matches_non_streaming(client, raylm_app):
    kwargs = dict(model=raylm_app.model, messages=QUESTION, temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_prompt_forms(client, raylm_app, bundled_model):
    text = client.completions.create(model=raylm_app.model, prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    ids = bundled_model.tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=raylm_app.model, prompt=ids, max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == by_ids.choices[0].text
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 8
    assert text.choices[0].finish_reason == "length"
    batch = client.completions.create(model=raylm_app.model, prompt=["The capital of France is", "1, 2, 3,"],
                                      max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text.choices[0].text
    assert batch.choices[2].text == batch.choices[3].text != text.choices[0].text


def test_n_completions_sampled_differ(client, raylm_app):
    reply = client.chat.completions.create(model=raylm_app.model, messages=QUESTION, n=2, temperature=1.0,
                                           max_tokens=24, seed=7)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage.completion_tokens <= 2 * 24


def test_seed_reproducible(client, raylm_app):
    kwargs = dict(model=raylm_app.model, messages=QUESTION, temperature=1.0, max_tokens=24)
    first = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    again = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    others = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert first == again
    assert len(others | {first}) > 1


def test_stop_strings(client, raylm_app):
    kwargs = dict(model=raylm_app.model, messages=QUESTION, temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert " Paris" in full
    cut = client.chat.completions.create(**kwargs, stop=[" Paris", "zzz"]).choices[0]
    assert cut.message.content == full[: full.index(" Paris")]
    assert cut.finish_reason == "stop"
    streamed = client.chat.completions.create(**kwargs, stop=" Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut.message.content


def test_logprobs(client, raylm_app):
    reply = client.chat.completions.create(model=raylm_app.model, messages=QUESTION, temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob <= 0
    legacy = client.completions.create(model=raylm_app.model, prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == legacy.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


PERSON = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30}, "city": {"type": "string",
          "maxLength": 30}}, "required": ["country", "city"], "additionalProperties": False}


def test_structured_output_through_the_openai_client(client, raylm_app):
    """response_format json_schema (streamed and not), vLLM's guided_choice as an extra body
    field, and a schema that cannot compile: 400 with the compiler's message."""
    kwargs = dict(model=raylm_app.model, messages=QUESTION, temperature=0, max_tokens=60,
                  response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PERSON}})
    reply = client.chat.completions.create(**kwargs)
    value = json.loads(reply.choices[0].message.content)
    assert list(value) == ["country", "city"] and reply.choices[0].finish_reason == "stop"  # the schema's order
    streamed = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content

    choice = client.completions.create(model=raylm_app.model, prompt="Is Paris in France? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": [" yes", " no"]})
    assert choice.choices[0].text in (" yes", " no") and choice.choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**kwargs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}})
    assert "Invalid type: nonsense" in err.value.message


def test_logit_bias_through_the_openai_client(client, raylm_app, bundled_model):
    prompt = "The capital of France is"
    kwargs = dict(model=raylm_app.model, prompt=prompt, temperature=0, max_tokens=4)
    free = client.completions.create(**kwargs).choices[0].text
    first = bundled_model.tokenizer.encode(free)[0]  # the greedy reply's first token
    banned = client.completions.create(**kwargs, logit_bias={str(first): -100}).choices[0].text
    assert bundled_model.tokenizer.encode(banned)[0] != first
    forced = bundled_model.tokenizer.encode(" banana")[0]
    forced_text = client.completions.create(**kwargs, logit_bias={str(forced): 100}).choices[0].text
    assert forced_text == bundled_model.tokenizer.decode([forced] * 4)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_through_the_openai_client(client, raylm_app):
    """required and a named function give calls that follow the tool's schema (streamed too);
    a conversation carrying the call and its result gets an answer."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=raylm_app.model, messages=ask, temperature=0, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL])
    reply = client.chat.completions.create(**kwargs, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    call = reply.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))

    named = client.chat.completions.create(**kwargs, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")

    stream = list(client.chat.completions.create(**kwargs, tool_choice={"type": "function",
                                                                        "function": {"name": "get_time"}}, stream=True))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    entries = [t for d in deltas for t in (d.tool_calls or [])]
    # OpenAI's stream shape: the id and name first, then the arguments in pieces; put together
    # (as the client's stream helpers do) they are the non-streamed call.
    assert len(entries) >= 2 and {t.index for t in entries} == {0}
    assert entries[0].id.startswith("call_") and entries[0].function.name == "get_time"
    assert all(t.id is None and t.function.name is None for t in entries[1:])
    assert "".join(t.function.arguments or "" for t in entries) == call.function.arguments
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "tool_calls"

    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    answer = client.chat.completions.create(**{**kwargs, "messages": history}, tool_choice="none").choices[0]
    assert answer.message.content and not answer.message.tool_calls
    # A tool result must answer a call of the assistant message before it (OpenAI's rule).
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**kwargs, "messages": [*history[:2], {**history[2], "tool_call_id": "call_9"}]})
    assert err.value.body["param"] == "messages[2].tool_call_id" and "'call_9'" in err.value.message


def test_tokenize_and_detokenize_over_http(client, raylm_app):
    """vLLM's endpoints (plain HTTP: the openai client has no call for them): a conversation's
    count is the prompt_tokens its chat completion reports, and the ids decode to its prompt."""
    reply = client.chat.completions.create(model=raylm_app.model, messages=QUESTION, max_tokens=1)
    tokenized = httpx.post(f"{raylm_app.base_url}/tokenize", json={"model": raylm_app.model, "messages": QUESTION},
                           timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == reply.usage.prompt_tokens and body["max_model_len"] == 1024
    text = httpx.post(f"{raylm_app.base_url}/detokenize", json={"tokens": body["tokens"]}, timeout=60).json()["prompt"]
    assert text.startswith("<|im_start|>") and text.endswith(f"{QUESTION[0]['content']}<|im_end|>\n"
                                                            "<|im_start|>assistant\n")
    unknown = httpx.post(f"{raylm_app.base_url}/tokenize", json={"model": "gpt-4o", "prompt": "Hi"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_embeddings_through_the_openai_client(client, raylm_app, offline_engine, bundled_model):
    """Floats and base64 (the client's default) decode to the offline engine's vectors; token-id
    input works; a bad field is a 400 naming it."""
    texts = ["The cat sat on the mat.", "Revenue grew by twelve percent."]
    reply = client.embeddings.create(model=raylm_app.model, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1] and reply.model == raylm_app.model
    ids = [bundled_model.tokenizer.encode(t) for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    for i, prompt in enumerate(ids):
        offline_engine.add_request(f"embed-{i}", prompt, SamplingParams(max_tokens=1), embed=True)
    expected = {}
    while offline_engine.has_unfinished_requests():
        for out in offline_engine.step():
            if out.finished:
                expected[out.request_id] = out.embedding
    for i, data in enumerate(reply.data):
        assert len(data.embedding) == bundled_model.config.hidden_size
        assert max(abs(a - b) for a, b in zip(data.embedding, expected[f"embed-{i}"])) < 1e-5
    by_ids = client.embeddings.create(model=raylm_app.model, input=ids[1])  # base64 on the wire
    assert max(abs(a - b) for a, b in zip(by_ids.data[0].embedding, expected["embed-1"])) < 1e-5
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=raylm_app.model, input=texts, dimensions=64)
    assert err.value.body["param"] == "dimensions"


def test_beam_search_through_the_api(client, raylm_app, bundled_model):
    """vLLM's use_beam_search: n beams, best first, the offline engine's beams."""
    from raylm.workers.core.sampling_params import BeamSearchParams
    from raylm.workers.engine.llm import LLM

    prompt = "The capital of France is"
    reply = client.completions.create(model=raylm_app.model, prompt=prompt, n=3, max_tokens=8,
                                      extra_body={"use_beam_search": True})
    offline = LLM(bundled_model, **TEST_DEPLOY["engine"]).beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [b.text for b in offline[0]]
    assert len({c.text for c in reply.choices}) == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=raylm_app.model, prompt=prompt, n=2, max_tokens=4, stop=["."],
                                  extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "stop"


def test_hidden_states_through_the_api(client, raylm_app, bundled_model):
    """raylm's extension on /v1/completions: the layers asked for, base64 float32, equal to the
    offline engine's; streamed, they come with the finish. Bad asks are 400s."""
    import base64

    import httpx
    import numpy as np

    from raylm.workers.engine.llm import LLM

    prompt, layers = "The capital of France is", [0, 7, bundled_model.config.num_layers]
    extra = {"return_hidden_states": layers, "hidden_states_include_prompt": True}
    reply = client.completions.create(model=raylm_app.model, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body=extra).model_dump()["choices"][0]
    hidden = reply["hidden_states"]
    array = np.frombuffer(base64.b64decode(hidden["data"]), "<f4").reshape(hidden["shape"])
    offline = LLM(bundled_model, **TEST_DEPLOY["engine"]).generate(
        prompt, SamplingParams(max_tokens=6, temperature=0, return_hidden_states=layers,
                               hidden_states_include_prompt=True))[0]
    assert hidden["layers"] == layers and hidden["dtype"] == "float32"
    assert array.shape == offline.outputs[0].hidden_states.shape
    assert array.shape[1] == len(offline.prompt_token_ids) + 6 - 1
    np.testing.assert_allclose(array, offline.outputs[0].hidden_states, atol=1e-4, rtol=1e-4)

    stream = client.completions.create(model=raylm_app.model, prompt=prompt, max_tokens=6, temperature=0,
                                       stream=True, extra_body=extra)
    finals = [c.model_dump()["choices"][0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert finals and finals[-1]["hidden_states"]["shape"] == hidden["shape"]

    for body, param in [({"return_hidden_states": [999]}, None), ({"return_hidden_states": "all"}, "return_hidden_states"),
                        ({"return_hidden_states": [1], "n": 2}, None)]:
        response = httpx.post(f"{raylm_app.base_url}/v1/completions", timeout=60,
                              json={"model": raylm_app.model, "prompt": prompt, "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        if param:
            assert response.json()["error"]["param"] == param
    chat = httpx.post(f"{raylm_app.base_url}/v1/chat/completions", timeout=60, json={
        "model": raylm_app.model, "messages": QUESTION, "return_hidden_states": [1]})
    assert chat.status_code == 400 and "return_hidden_states" in chat.text
