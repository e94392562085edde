"""LoRA adapters over HTTP on a real Ray cluster, with the official ``openai`` client: the request's
``model`` picks the adapter, and each answer (beam search too) equals the offline engine's with
that adapter."""

from __future__ import annotations

import pytest

from tests.checkpoints import build_tiny_checkpoint
from tests.lora_adapters import MODULES, write_adapter
from workers import LLM, LoRARequest, SamplingParams
from workers.sampling_params import BeamSearchParams

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
    yield app, str(path), adapters
    serve_cluster.remove(app)


def test_each_adapter_answers_as_offline(lora_app, capsys):
    app, path, adapters = lora_app
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

    from deploy.cli import main

    assert main(["status", "--app", "lora"]) == 0
    assert "sql, chat" in capsys.readouterr().out  # the replica's resident adapters, by slot
