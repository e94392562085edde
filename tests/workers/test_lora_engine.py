"""LoRA adapters in the engine: batches mixing adapters and base rows, more adapters than device
slots (LRU), prefix caching and n-gram speculation, each request against HF transformers with
its adapter merged into the weights; on an int8 base over two devices with a JSON schema and
speculation, against HF on the same int8 weights; on a GGUF file's Q8_0 blocks kept as stored,
against HF on the weights the file holds."""

from __future__ import annotations

import copy
import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest
import torch

from raylm.model.config.model_info import load_model_info
from raylm.model.decoder.lora_slots import PackedLoraWeights
from raylm.model.kernels import lora_delta
from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, round_to_stored
from tests.lora_adapters import MODULES, write_adapter
from tests.reference import hf_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# (rank, alpha, targets, rsLoRA) of five adapters: one more than the replica's slots.
ADAPTERS = [
    (4, 8, list(MODULES), False),
    (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    (2, 4, ["gate_proj", "up_proj", "down_proj"], False),
    (8, 8, ["q_proj", "v_proj"], False),
    (4, 4, ["o_proj", "down_proj"], True),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    path, hf = build_tiny_checkpoint("llama-gqa", root / "base")
    requests, references = [None], [hf]
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        directory, merged = write_adapter(root / f"adapter{i}", hf, rank, alpha, targets, seed=i, use_rslora=rslora)
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(directory)))
        references.append(merged)
    return path, requests, references


def test_mixed_adapters_lru_slots_and_prefix_cache_match_merged_hf(served):
    path, requests, references = served
    rng = np.random.RandomState(0)
    # A 40-token prompt (two full blocks: prefix-cache entries) that repeats itself (n-gram
    # guesses from the first decode on), and a short one.
    prompts = [np.tile(rng.randint(3, 320, size=8), 5).tolist(), rng.randint(3, 320, size=5).tolist()]
    expected = {(p, a): hf_greedy(references[a], prompts[p], NEW_TOKENS)
                for p in range(len(prompts)) for a in range(len(requests))}
    assert len({tuple(tokens) for (p, _), tokens in expected.items() if p == 0}) == len(requests)  # adapters matter

    llm = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=5, max_num_seqs=16,
              num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=128,
              speculative=dict(method="ngram", num_speculative_tokens=3))
    engine = llm.engine
    # Round one: every (prompt, adapter) pair at once. Four adapters fill the slots and share
    # batches with base rows; the fifth waits until a slot's requests finish, then takes it.
    # Round two, in the other order: the prompt's cached blocks are reused by its own adapter only.
    for order in (range(len(requests)), reversed(range(len(requests)))):
        pairs = [(p, a) for a in order for p in range(len(prompts))]
        outputs = llm.generate([{"prompt_token_ids": prompts[p]} for p, _ in pairs], GREEDY,
                               lora_request=[requests[a] for _, a in pairs])
        for (p, a), out in zip(pairs, outputs):
            assert out.outputs[0].token_ids == expected[p, a], (p, a)
    slots = engine.scheduler.lora_slots
    assert sum(slots.loads.values()) > 4 and sum(slots.evictions.values()) > 0
    stats = engine.stats()
    assert stats.pool.prefix_hits > 0 and stats.spec.num_drafts > 0
    assert len(stats.lora.resident) == 4 and stats.lora.loads == dict(slots.loads) and stats.lora.in_use == 0
    # Nothing leaks: no slot held, no block used.
    assert slots.num_in_use == 0 and stats.running == stats.waiting == 0
    assert stats.pool.num_used_blocks == 0 and stats.pool.num_free_blocks == stats.pool.num_usable_blocks


def test_lora_requests_are_checked_when_they_arrive(served, tmp_path):
    path, requests, _ = served
    plain = LLM(str(path), max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, lora_request=requests[1])
    llm = LLM(str(path), enable_lora=True, max_lora_rank=4, max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_lora_rank 4"):
        llm.generate("hi", GREEDY, lora_request=requests[2])  # rank 8
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "nowhere")))
    llm.engine.add_request("known", [5, 6], GREEDY, lora_request=requests[1])
    with pytest.raises(ValueError, match="is taken"):
        llm.engine.add_request("clash", [5, 6], GREEDY, lora_request=LoRARequest("adapter0", 1, str(tmp_path)))
    llm.engine.abort("known")
    assert not llm.engine.has_unfinished_requests()


# A schema the tiny byte-level tokenizer can spell; half of the requests are held to it.
SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
    "required": ["ok", "tag"], "additionalProperties": False}))


def _as_int8(model, merged):
    """``merged`` (``model`` with an adapter merged in) as raylm serves it on int8 weights: every
    matrix of ``model`` rounded per output channel to 127 steps of its largest magnitude
    (model/quantization/quant_array.py), the adapter's delta on top in float32."""
    out = copy.deepcopy(merged)
    with torch.no_grad():
        base = dict(model.named_parameters())
        for name, param in out.named_parameters():
            w = base[name]
            if w.ndim == 2:
                absmax = w.abs().amax(dim=1, keepdim=True)
                scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
                param.add_(torch.clamp(torch.round(w / scale), -127, 127) * scale - w)
    return out.eval()


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")
def test_adapters_on_an_int8_base_over_tp2_with_grammar_and_speculation(served):
    """One engine with everything at once: int8 weights sharded over two devices, n-gram
    speculation, a JSON schema on half of the rows, adapters mixed with a base row. Free rows
    equal HF's on the same int8 weights with the adapter merged; held rows are the schema's.
    (GGUF blocks are served on one device only; their delta is added after the base matmul
    as int8's is.)"""
    path, requests, references = served
    rng = np.random.RandomState(3)
    prompt = np.tile(rng.randint(3, 320, size=6), 4).tolist()  # repeats itself: n-gram guesses
    # The base model and three adapters (attention and MLP, attention, MLP only) over two slots;
    # the first two rows free, the others held to the schema.
    held = dataclasses.replace(GREEDY, max_tokens=40, structured_output=SCHEMA, ignore_eos=False)
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=32, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=32, quantization="int8", tensor_parallel_size=2,
              speculative=dict(method="ngram", num_speculative_tokens=3))
    outputs = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 4, [GREEDY, GREEDY, held, held], lora_request=requests[:4])]
    for row in (0, 1):
        assert outputs[row] == hf_greedy(_as_int8(references[0], references[row]), prompt, NEW_TOKENS), row
    assert outputs[0] != outputs[1]  # the adapter matters
    tokenizer = load_model_info(path).tokenizer
    for tokens in outputs[2:]:
        value = json.loads(tokenizer.decode(tokens))
        assert set(value) == {"ok", "tag"} and value["tag"] in ("red", "blue")
    # int8 slots exist only for the CPU kernel, which a sharded replica does not run.
    with pytest.raises(ValueError, match="lora_dtype int8 needs the CPU LoRA kernel"):
        LLM(str(path), enable_lora=True, max_lora_rank=8, num_kv_blocks=32, max_model_len=64, tensor_parallel_size=2,
            lora_dtype="int8")


@pytest.mark.parametrize("lora_dtype", [None, "bfloat16", "int8"])
def test_adapters_on_gguf_blocks_kept_as_stored_match_merged_hf(tmp_path, lora_dtype):
    """The CPU kernel path reads a GGUF's Q8_0 blocks as stored and adds each row's adapter delta
    after the base matmul, from slots packed in one array: two adapters and a base row in one
    batch equal HF on the file's (dequantized) weights with each adapter merged. With bfloat16 or
    int8 slots (``engine.lora_dtype``) the adapters hold values of that type (int8: a scale per A
    row and B output) and power-of-two scales, so the slots hold them exactly and the kernel's
    widening and scaling is what is checked. Without the kernel (an accelerator, or no compiler
    at install) XLA adds the deltas over the blocks; int8 slots exist only for the kernel."""
    kernel = jax.default_backend() == "cpu" and lora_delta.available()
    if lora_dtype == "int8" and not kernel:
        pytest.skip("int8 slots need the C++ LoRA kernel on CPU")
    qtype = gguf.GGMLQuantizationType.Q8_0
    directory, hf = build_tiny_checkpoint("llama-gqa", tmp_path / "base")
    path = export_gguf(directory, tmp_path / "base.gguf", qtype)
    round_to_stored(hf, qtype)  # the reference: HF on the weights the file holds
    requests, references = [None], [hf]
    for i, (rank, alpha, targets, rslora) in enumerate([ADAPTERS[0], ADAPTERS[2] if lora_dtype else ADAPTERS[1]]):
        adapter, merged = write_adapter(tmp_path / f"adapter{i}", hf, rank, alpha, targets, seed=i, use_rslora=rslora,
                                        values_of=lora_dtype)
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(adapter)))
        references.append(merged)
    prompt = np.random.RandomState(5).randint(3, 320, size=19).tolist()
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=32, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=32, gguf_blocks="keep", lora_dtype=lora_dtype)
    runner = llm.engine.runner
    assert type(runner.params.layers[0].wqkv).__name__ == "GgufBlocks"
    if kernel:
        assert isinstance(runner.lora.weights, PackedLoraWeights) and isinstance(runner.lora.weights.buffer, jax.Array)
        assert runner.lora.weights.buffer.dtype == jax.numpy.dtype(lora_dtype or np.float32)
    outputs = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 3, GREEDY, lora_request=requests)]
    assert outputs == [hf_greedy(reference, prompt, NEW_TOKENS) for reference in references]
    assert len({tuple(tokens) for tokens in outputs}) == 3  # each adapter matters
