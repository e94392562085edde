"""LoRA adapters through the router: a request's ``model`` names the adapter, ``/v1/models`` lists
the adapters with the base model as their parent, an unknown name is a 404, and the prompt's
block hashes (prefix routing) are the adapter's own. In-process over a fake worker."""

from __future__ import annotations

import asyncio
import json

from model import DEFAULT_MODEL, load_model_info
from router.openai_service import OpenAIService
from tests.fake_worker import FakeWorker, asgi_request, chunk, fake_settings, post_json


def test_adapters_are_served_as_models_of_the_base():
    settings = fake_settings(lora_modules={"sql": "/adapters/sql", "chat": "/adapters/chat"}, cache_salt="base")
    service = OpenAIService(FakeWorker([chunk("a", finished=True)]), settings, load_model_info(DEFAULT_MODEL).tokenizer)
    service.admission.set_capacity(4)
    app = service.asgi_app()
    prompt = "count: " + " ".join(map(str, range(40)))  # several full KV blocks

    async def run():
        listed = await asgi_request(app, "GET", "/v1/models", b"")
        card = await asgi_request(app, "GET", "/v1/models/sql", b"")
        answers = [await post_json(app, {"model": model, "prompt": prompt, "max_tokens": 1})
                   for model in ("sql", "m", "chat", "nope")]
        return listed, card, answers

    listed, card, answers = asyncio.run(run())
    models = {m["id"]: m for m in json.loads(listed.body)["data"]}
    assert list(models) == ["m", "sql", "chat"]
    assert models["m"]["parent"] is None and models["chat"] == {**models["m"], "id": "chat", "root": "/adapters/chat",
                                                              "parent": "m"}
    assert json.loads(card.body)["parent"] == "m"
    assert [a.status for a in answers] == [200, 200, 200, 404]
    assert json.loads(answers[3].body)["error"]["code"] == "model_not_found"
    sent = service.worker.requests
    assert [r.lora_name for r in sent] == ["sql", None, "chat"]
    hashes = [tuple(r.block_hashes) for r in sent]
    assert all(hashes) and len(set(hashes)) == 3  # the same prompt, three models: never the same KV
