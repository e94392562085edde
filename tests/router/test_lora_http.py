"""LoRA adapters over HTTP on a real Ray cluster, with the official ``openai`` client: the request's
``model`` picks the adapter, and each answer (beam search too) equals the offline engine's with
that adapter. Adapters loaded and unloaded during traffic lose no request and leak nothing, and
the per-adapter metrics reach Prometheus."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from raylm.benchmarks.prometheus_scrape import counter_by_label
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import BeamSearchParams, SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.wire.replica_protocol import replica_reports
from tests.checkpoints import build_tiny_checkpoint
from tests.lora_adapters import MODULES, write_adapter

openai = pytest.importorskip("openai")

PROMPT = [5, 17, 42, 99, 7, 3, 250, 18, 64, 11]
ENGINE = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_model_len": 128, "max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def lora_app(serve_cluster, tmp_path_factory):
    """A tiny model with two adapters, served by one replica."""
    root = tmp_path_factory.mktemp("lora-http")
    path, hf = build_tiny_checkpoint("llama-gqa", root / "base")
    adapters = {name: str(write_adapter(root / name, hf, 4, 8, targets, seed)[0])
                for name, targets, seed in [("sql", list(MODULES), 1), ("chat", ["q_proj", "down_proj"], 2)]}
    app = serve_cluster.deploy({
        "name": "lora", "model": {"name": str(path), "served_model_name": "tiny",
                                  "lora_modules": [{"name": n, "path": p} for n, p in adapters.items()]},
        "workers": {"num_replicas": 1}, "engine": ENGINE,
    }, route_prefix="/lora")
    yield app, str(path), adapters, hf
    serve_cluster.remove(app)


def test_each_adapter_answers_as_offline(lora_app, capsys):
    app, path, adapters, _ = lora_app
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "sql", "chat"] and models["sql"].parent == "tiny"
    served = {model: client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
              for model in models}
    assert len(set(served.values())) == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)

    offline = LLM(path, enable_lora=True, **ENGINE)
    requests = [None] + [LoRARequest(name, i, adapter) for i, (name, adapter) in enumerate(adapters.items(), 1)]
    outputs = offline.generate([{"prompt_token_ids": PROMPT}] * 3, SamplingParams(max_tokens=8, temperature=0),
                               lora_request=requests)
    assert [o.outputs[0].text for o in outputs] == [served["tiny"], served["sql"], served["chat"]]

    # Beam search with an adapter: every beam step runs with it.
    beams = client.completions.create(model="sql", prompt=PROMPT, n=2, max_tokens=4,
                                      extra_body={"use_beam_search": True})
    expected = offline.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=2, max_tokens=4),
                                   lora_request=requests[1])
    assert [c.text for c in beams.choices] == [b.text for b in expected[0]]

    from raylm.deploy.cli import main

    assert main(["status", "--app", "lora"]) == 0
    assert "sql, chat" in capsys.readouterr().out  # the replica's resident adapters, by slot


def test_adapters_load_and_unload_during_traffic(lora_app, serve_cluster, tmp_path):
    """An adapter loaded while others run serves at once; unloaded while its requests run, they
    finish and new ones get 404; loaded again with other weights under its name, it answers with
    those (a fresh slot and its own prefix-cache keys). Nothing is lost, nothing is left held."""
    app, _, _, hf = lora_app
    versions = [str(write_adapter(tmp_path / f"v{i}", hf, 8, 16, list(MODULES), seed=10 + i)[0]) for i in range(2)]
    prompt = PROMPT * 4  # 40 tokens: two full KV blocks, cached under each adapter's own keys
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def traffic():
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            async def complete(model: str, started: asyncio.Event | None = None) -> tuple[int, str]:
                async with client.stream("POST", "/v1/completions", json={**body, "model": model, "stream": True}) as r:
                    text = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            if started is not None:
                                started.set()
                    return r.status_code, "".join(text)

            async def admin(path: str, name: str, lora_path: str | None = None) -> int:
                payload = {"lora_name": name, **({"lora_path": lora_path} if lora_path else {})}
                return (await client.post(f"/v1/{path}_lora_adapter", json=payload)).status_code

            others = [asyncio.create_task(complete(m)) for m in ("tiny", "sql", "chat", "tiny")]
            assert await admin("load", "fresh", versions[0]) == 200
            started = [asyncio.Event() for _ in range(3)]
            first = [asyncio.create_task(complete("fresh", e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            assert await admin("unload", "fresh") == 200  # while its three requests stream
            gone = await client.post("/v1/completions", json={**body, "model": "fresh"})
            assert await admin("unload", "fresh") == 404
            assert await admin("load", "fresh", versions[1]) == 200
            second = await complete("fresh")
            assert await admin("unload", "fresh") == 200
            return await asyncio.gather(*others), await asyncio.gather(*first), gone.status_code, second

    others, first, gone, second = asyncio.run(traffic())
    assert all(status == 200 for status, _ in others + first + [second]), (others, first, second)
    assert gone == 404
    assert len({text for _, text in first}) == 1 and first[0][1] not in (others[0][1], second[1])

    deadline = time.monotonic() + 30
    while True:  # the replica's report and Prometheus trail the traffic by a period or two
        (engine,) = (report.engine for report in replica_reports("lora").values())
        counted = {name: counter_by_label(serve_cluster.metrics_port, f"ray_raylm_lora_{name}_total", "lora_name")
                   for name in ("requests", "generation_tokens", "loads", "evictions")}
        idle = engine.running == engine.waiting == engine.pool.num_used_blocks == engine.lora.in_use == 0
        # sql, chat and fresh over two slots: some adapter was evicted
        evictions = sum(engine.lora.evictions.values())
        arrived = counted["requests"].get("fresh") == 4 and sum(counted["evictions"].values()) == evictions >= 1
        if (idle and arrived) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, engine
    assert counted["requests"].get("fresh") == 4 and counted["generation_tokens"].get("fresh") == 4 * 16, counted
    assert counted["loads"].get("fresh", 0) >= 2 and counted["requests"].get("sql", 0) >= 1, counted
    assert sum(counted["evictions"].values()) == evictions >= 1, (counted, engine.lora)
