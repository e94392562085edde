"""vLLM's ``/tokenize`` and ``/detokenize`` on the router in-process (ASGI over a fake worker):
the ids are the ones generation sends to the workers, the shapes are vLLM's, and every bad
request is OpenAI error JSON naming its field. Over real HTTP: tests/router/test_openai_api.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.processors import TemplateProcessing

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.auth import Secret
from raylm.router.openai_service import OpenAIService
from tests.fake_worker import FakeWorker, asgi_request, chunk, fake_settings, post_json

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def _service(tokenizer: Tokenizer, **settings) -> OpenAIService:
    service = OpenAIService(FakeWorker([chunk("a", finished=True)]), fake_settings(**settings), tokenizer)
    service.admission.set_capacity(4)
    return service


def _post(service: OpenAIService, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    raw = json.dumps(body).encode()
    answer = asyncio.run(asgi_request(service.asgi_app(), "POST", path, raw,
                                      {"content-type": "application/json", **(headers or {})}))
    return answer.status, json.loads(answer.body)


def test_tokenize_gives_the_ids_generation_sends_to_the_workers(tokenizer):
    service = _service(tokenizer)
    app = service.asgi_app()
    asyncio.run(post_json(app, {"model": "m", "messages": CHAT, "tools": [WEATHER], "max_tokens": 1},
                          "/v1/chat/completions"))
    asyncio.run(post_json(app, {"model": "m", "prompt": "The capital of France is", "max_tokens": 1}))
    asyncio.run(post_json(app, {"model": "m", "prompt": "", "max_tokens": 1}))  # starts a new document
    chat_ids, prompt_ids, empty_ids = (r.prompt_token_ids for r in service.worker.requests)

    status, chat = _post(service, "/tokenize", {"model": "m", "messages": CHAT, "tools": [WEATHER]})
    assert status == 200 and chat == {"count": len(chat_ids), "max_model_len": 512, "tokens": chat_ids,
                                      "token_strs": None}
    status, plain = _post(service, "/tokenize", {"prompt": "The capital of France is"})  # model is optional
    assert status == 200 and plain["tokens"] == prompt_ids and plain["count"] == len(prompt_ids)
    _, empty = _post(service, "/tokenize", {"prompt": ""})
    assert empty["tokens"] == empty_ids and len(empty_ids) == 1

    # Without the generation prompt: the same conversation less ChatML's assistant header.
    _, bare = _post(service, "/tokenize", {"messages": CHAT, "tools": [WEATHER], "add_generation_prompt": False})
    assert chat_ids[:len(bare["tokens"])] == bare["tokens"]
    _, header = _post(service, "/detokenize", {"tokens": chat_ids[len(bare["tokens"]):]})
    assert header == {"prompt": "<|im_start|>assistant\n"}


def test_token_strings_and_detokenize_keep_special_tokens(tokenizer):
    service = _service(tokenizer)
    _, hello = _post(service, "/tokenize", {"model": "m", "prompt": "Hello world", "return_token_strs": True})
    assert hello["token_strs"] == ["Hello", "Ġworld"] and len(hello["tokens"]) == 2  # GPT-2 byte-level pieces
    _, chat = _post(service, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    _, text = _post(service, "/detokenize", {"model": "m", "tokens": chat["tokens"]})
    assert text["prompt"] == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                              "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert _post(service, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_add_special_tokens_defaults_as_vllm_on_a_tokenizer_that_adds_bos(tokenizer):
    """Prompts get the tokenizer's BOS by default, conversations do not (their template places it)."""
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    with_bos = Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                         chat_template=tokenizer.chat_template)
    service = _service(with_bos)
    plain = tokenizer.encode("Hello world")
    assert _post(service, "/tokenize", {"prompt": "Hello world"})[1]["tokens"] == [1, *plain]
    assert _post(service, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})[1]["tokens"] == plain
    chat = tokenizer.encode_chat(CHAT)
    assert _post(service, "/tokenize", {"messages": CHAT})[1]["tokens"] == chat
    assert _post(service, "/tokenize", {"messages": CHAT, "add_special_tokens": True})[1]["tokens"] == [1, *chat]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),  # chat only
    ("/tokenize", {"messages": CHAT, "echo": True}, 400, "echo"),
    ("/tokenize", {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": 7, "prompt": "x"}, 400, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/tokenize", {"messages": [*CHAT, {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]}, 400,
     "messages[2].role"),
    ("/detokenize", {"model": "m"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),  # the vocabulary is 49152
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "model"),
])
def test_bad_requests_are_openai_errors_naming_the_field(tokenizer, path, body, status, param):
    answer_status, answer = _post(_service(tokenizer), path, body)
    assert answer_status == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param, answer


def test_api_keys_guard_tokenize_and_detokenize(tokenizer):
    service = _service(tokenizer, api_keys=Secret({"sk-alice": "alice"}))
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert _post(service, path, body)[0] == 401
        assert _post(service, path, body, {"authorization": "Bearer sk-wrong"})[0] == 401
        assert _post(service, path, body, {"authorization": "Bearer sk-alice"})[0] == 200
    wrong_method = asyncio.run(asgi_request(service.asgi_app(), "GET", "/tokenize", b""))
    assert wrong_method.status == 405 and "error" in json.loads(wrong_method.body)
