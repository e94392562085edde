"""Reasoning output through the router's HTTP API with the official ``openai`` client (in-process,
over a fake worker that writes a scripted reply token by token): a Qwen3-style template (the
model opens ``<think>``, which is one token) and a DeepSeek-R1-style one (the prompt opens it;
the tags are several tokens each, so they arrive split). Thoughts go to ``reasoning_content``,
the answer to ``content``, whole and streamed; ``enable_thinking: false`` reaches the template."""

from __future__ import annotations

import asyncio
import copy

import pytest
from tokenizers import AddedToken

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.openai_service import OpenAIService
from tests.fake_worker import FakeWorker, fake_settings, openai_client, token_chunks

openai = pytest.importorskip("openai")

QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}")
R1_TEMPLATE = ("{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHTS, ANSWER = "\nTwo and two make four.\n", "The answer is 4."


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer) -> Tokenizer:
    """The bundled tokenizer with a Qwen3-style template and ``<think>`` / ``</think>`` as single
    (non-special, as in Qwen3's vocabulary) tokens."""
    qwen3 = copy.copy(tokenizer)
    qwen3.backend = copy.deepcopy(tokenizer.backend)
    qwen3.backend.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    qwen3.chat_template = QWEN3_TEMPLATE
    return qwen3


@pytest.fixture(scope="module")
def r1_tokenizer(tokenizer) -> Tokenizer:
    r1 = copy.copy(tokenizer)
    r1.chat_template = R1_TEMPLATE
    return r1


def _service(tokenizer: Tokenizer, reply: str, finish: str = "stop") -> OpenAIService:
    service = OpenAIService(FakeWorker(token_chunks(tokenizer, reply, finish)), fake_settings(), tokenizer)
    service.admission.set_capacity(4)
    return service


async def _whole_and_streamed(service: OpenAIService, **kwargs):
    client = openai_client(service)
    whole = await client.chat.completions.create(model="m", messages=ASK, **kwargs)
    stream = await client.chat.completions.create(model="m", messages=ASK, stream=True,
                                                  stream_options={"include_usage": True}, **kwargs)
    chunks = [c async for c in stream]
    return whole, chunks


def _joined(chunks, field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks if c.choices)


@pytest.mark.parametrize("style", ["qwen3", "deepseek_r1"])
def test_thoughts_and_answer_come_apart_whole_and_streamed(style, qwen3_tokenizer, r1_tokenizer):
    tokenizer = qwen3_tokenizer if style == "qwen3" else r1_tokenizer
    reply = f"<think>{THOUGHTS}</think>\n\n{ANSWER}" if style == "qwen3" else f"{THOUGHTS}</think>\n\n{ANSWER}"
    if style == "deepseek_r1":  # the tags are not one token: they arrive in pieces
        assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    service = _service(tokenizer, reply)
    whole, chunks = asyncio.run(_whole_and_streamed(service))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHTS, ANSWER)
    assert message.model_extra["reasoning"] == THOUGHTS  # vLLM's name too
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == (THOUGHTS, ANSWER)
    assert _joined(chunks, "reasoning") == THOUGHTS
    # Every reasoning piece comes before the first piece of the answer.
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
             for c in chunks if c.choices and (c.choices[0].delta.content or
                                               getattr(c.choices[0].delta, "reasoning_content", None))]
    assert kinds == sorted(kinds, reverse=True) and kinds[0] == "r"
    thought_tokens = len(tokenizer.encode(reply[: reply.index("</think>") + len("</think>")],
                                          add_special_tokens=False))
    assert whole.usage.completion_tokens_details.reasoning_tokens == thought_tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought_tokens
    prompt = tokenizer.decode(service.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n" if style == "qwen3" else "<think>\n")


def test_a_reply_cut_short_inside_its_thoughts_is_all_reasoning(r1_tokenizer):
    whole, chunks = asyncio.run(_whole_and_streamed(_service(r1_tokenizer, "Let me think about </thi", "length")))
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (
        "Let me think about </thi", "")
    assert _joined(chunks, "reasoning_content") == "Let me think about </thi" and _joined(chunks, "content") == ""
    assert whole.choices[0].finish_reason == "length"


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_answer(qwen3_tokenizer):
    service = _service(qwen3_tokenizer, ANSWER)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole, chunks = asyncio.run(_whole_and_streamed(service, extra_body=off))
    prompt = qwen3_tokenizer.decode(service.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert whole.choices[0].message.content == ANSWER and _joined(chunks, "content") == ANSWER
    assert "reasoning_content" not in whole.choices[0].message.model_extra
    tokenized = asyncio.run(openai_client(service).post("http://router/tokenize", cast_to=object, body={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}))
    assert tokenized["tokens"] == service.worker.requests[0].prompt_token_ids  # /tokenize renders it the same
    # With thinking off, structured output applies to the whole reply, so it is allowed.
    asyncio.run(openai_client(service).chat.completions.create(
        model="m", messages=ASK, response_format={"type": "json_object"}, extra_body=off))


@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"guided_regex": "[0-9]+"}}, "guided_regex"),  # cannot be moved past the thoughts
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # this template has no effort to set
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": [1]}}, "chat_template_kwargs"),
])
def test_what_cannot_be_done_is_a_clear_400(qwen3_tokenizer, kwargs, param):
    client = openai_client(_service(qwen3_tokenizer, ANSWER))
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(client.chat.completions.create(model="m", messages=ASK, **kwargs))
    assert err.value.body["param"] == param


def test_structured_output_applies_after_the_thoughts(qwen3_tokenizer):
    service = _service(qwen3_tokenizer, '<think>\nPlan.\n</think>\n\n{"a": 1}')
    reply = asyncio.run(openai_client(service).chat.completions.create(
        model="m", messages=ASK, response_format={"type": "json_object"}))
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("\nPlan.\n", '{"a": 1}')
    grammar = service.worker.requests[0].params.structured_output
    close = qwen3_tokenizer.token_to_id("</think>")  # one token: the grammar names it (router/reasoning_grammar.py)
    assert grammar.kind == "grammar" and f"raylm_thoughts <[{close}]>" in grammar.spec


def test_reasoning_effort_reaches_a_template_that_reads_it(tokenizer):
    effortful = copy.copy(tokenizer)
    effortful.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}Reasoning: {{ reasoning_effort }}"
    service = _service(effortful, ANSWER)
    reply = asyncio.run(openai_client(service).chat.completions.create(model="m", messages=ASK,
                                                                       reasoning_effort="high"))
    assert reply.choices[0].message.content == ANSWER and "reasoning_content" not in reply.choices[0].message.model_extra
    prompt = effortful.decode(service.worker.requests[0].prompt_token_ids)
    assert prompt.endswith("Reasoning: high")


def test_earlier_thoughts_sent_back_reach_the_template(qwen3_tokenizer):
    service = _service(qwen3_tokenizer, ANSWER)
    history = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
               {"role": "user", "content": "And 3 + 3?"}]
    asyncio.run(openai_client(service).chat.completions.create(model="m", messages=history))
    prompt = qwen3_tokenizer.decode(service.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>Two and two.</think>4<|im_end|>" in prompt
