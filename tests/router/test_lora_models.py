"""LoRA adapters through the router: a request's ``model`` names the adapter, ``/v1/models`` lists
the adapters with the base model as their parent, an unknown name is a 404, and the prompt's
block hashes (prefix routing) are the adapter's own; vLLM's load and unload endpoints, behind
admin keys, check an adapter in full before serving it. In-process over a fake worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from raylm.model.config.model_info import load_model_info
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.router.auth import Secret
from raylm.router.openai_service import OpenAIService
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
    assert [r.lora and (r.lora.lora_name, r.lora.lora_int_id) for r in sent] == [("sql", 1), None, ("chat", 2)]
    hashes = [tuple(r.block_hashes) for r in sent]
    assert all(hashes) and len(set(hashes)) == 3  # the same prompt, three models: never the same KV


def _write_adapter(directory: Path, rank: int, q_out: int = 576, **config) -> str:
    """A rank-``rank`` PEFT adapter of layer 0's q_proj of the bundled model (576 wide)."""
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                               "target_modules": ["q_proj"], **config}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): np.ones((rank, 576), np.float32), key.format("B"): np.ones((q_out, rank), np.float32)},
              str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_adapters_load_and_unload_over_http_behind_admin_keys(tmp_path):
    settings = fake_settings(lora_modules={"sql": "/adapters/sql"}, enable_lora=True, max_lora_rank=8,
                             api_keys=Secret({"user-key": "team"}), admin_api_keys=Secret({"admin-key": "admin"}))
    service = OpenAIService(FakeWorker([chunk("a", finished=True)]), settings,
                            load_model_info(DEFAULT_MODEL).tokenizer)
    service.admission.set_capacity(4)
    app = service.asgi_app()
    good = _write_adapter(tmp_path / "good", 4)
    bad = {"rank": _write_adapter(tmp_path / "rank", 16), "shape": _write_adapter(tmp_path / "shape", 4, q_out=64),
           "dora": _write_adapter(tmp_path / "dora", 4, use_dora=True), "missing": str(tmp_path / "nowhere")}
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    bad["broken"] = str(tmp_path / "broken")
    admin = {"authorization": "Bearer admin-key", "content-type": "application/json"}

    async def call(path: str, body: dict, key: str = "admin-key"):
        answer = await asgi_request(app, "POST", path, json.dumps(body).encode(),
                                    {"authorization": f"Bearer {key}", "content-type": "application/json"})
        return answer.status, (answer.body.decode() if answer.status == 200 else json.loads(answer.body)["error"])

    async def complete(model: str):
        return await asgi_request(app, "POST", "/v1/completions",
                                  json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode(), admin)

    async def run():
        load = "/v1/load_lora_adapter"
        out = {"user key": await call(load, {"lora_name": "new", "lora_path": good}, "user-key"),
               "no key": await call(load, {"lora_name": "new", "lora_path": good}, "wrong"),
               "no path": await call(load, {"lora_name": "new"})}
        out["bad"] = {name: await call(load, {"lora_name": name, "lora_path": path}) for name, path in bad.items()}
        out["taken"] = [await call(load, {"lora_name": name, "lora_path": good}) for name in ("sql", "m")]
        out["load"] = await call(load, {"lora_name": "new", "lora_path": good})
        out["again"] = await call(load, {"lora_name": "new", "lora_path": good})
        out["listed"] = json.loads((await asgi_request(app, "GET", "/v1/models", b"", admin)).body)["data"]
        out["served"] = await complete("new")
        out["unload"] = await call("/v1/unload_lora_adapter", {"lora_name": "new"})
        out["gone"] = await complete("new")
        out["unknown"] = await call("/v1/unload_lora_adapter", {"lora_name": "new"})
        out["static"] = await call("/v1/unload_lora_adapter", {"lora_name": "sql"})
        return out

    out = asyncio.run(run())
    assert out["user key"][0] == 403 and out["user key"][1]["code"] == "permission_denied"
    assert out["no key"][0] == 401 and out["no path"][0] == 400
    messages = {name: (status, error["message"]) for name, (status, error) in out["bad"].items()}
    assert all(status == 400 for status, _ in messages.values()), messages
    for name, words in [("rank", "max_lora_rank 8"), ("shape", "expected"), ("dora", "DoRA"),
                        ("missing", "adapter_config.json"), ("broken", "not valid JSON")]:
        assert words in messages[name][1], (name, messages[name])
    assert [status for status, _ in out["taken"]] == [400, 400]
    assert out["load"] == (200, "Success: LoRA adapter 'new' added successfully.")
    assert out["again"][0] == 400 and "already been loaded" in out["again"][1]["message"]
    assert [m["id"] for m in out["listed"]] == ["m", "sql", "new"] and out["listed"][2]["parent"] == "m"
    assert out["served"].status == 200
    sent = service.worker.requests[0].lora
    assert (sent.lora_name, sent.lora_path) == ("new", good) and sent.lora_int_id > 1
    assert out["unload"] == (200, "Success: LoRA adapter 'new' removed successfully.")
    assert out["gone"].status == 404 and json.loads(out["gone"].body)["error"]["code"] == "model_not_found"
    assert out["unknown"][0] == 404 and out["static"][0] == 400
    assert len(service.worker.requests) == 1  # nothing reached a worker but the one request
