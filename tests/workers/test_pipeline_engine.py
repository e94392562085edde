"""Pipeline parallelism in the engine: a replica's layers split into 2 or 3 stages (each with its
own weights and KV pool, the stages in this process: ``pipeline_placement: local``) gives HF
transformers' greedy tokens with batching, paging, chunked prefill, preemption, prefix-cache hits
and LoRA adapters, on a dense family with q/k norms, a mixture of experts, DeepSeek's latent
attention, Gemma 2 and 3's two KV groups and the bundled GGUF; a stage reads only its own
tensors; what the stages do not run is refused at load. (Stages as Ray actors:
tests/cluster/test_pipeline_ray.py.)"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.cache.kv_budget import group_blocks_for_budget
from raylm.model.config.model_info import load_model_info
from raylm.model.decoder.kv_pool import GroupedKV
from raylm.model.loaders.gguf_checkpoint import load_gguf_checkpoint
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.load import load_model
from raylm.model.quantization.quant_array import weight_bytes
from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.pipeline.micro_batches import plan_sequences
from raylm.workers.pipeline.stage_runners import split_layers
from raylm.workers.pipeline.support import largest_stage, stage_kv_group_layers
from tests.checkpoints import build_tiny_checkpoint
from tests.lora_adapters import MODULES, write_adapter
from tests.reference import family_cases, hf_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# A small pool (preemption), small steps (chunked prompts packed with decodes), two passes
# (the second hits the prefix cache).
SMALL = dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=24, pipeline_placement="local")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (path, prompts, HF's greedy continuations), each family built once."""
    return functools.cache(lambda name: _family(name, tmp_path_factory))


def _family(name, tmp_path_factory):
    path, prompts, expected = family_cases(name, tmp_path_factory.mktemp(name) / "m", NEW_TOKENS)
    return path, prompts, expected


# Gemma 3's three stages hold one layer each: sliding, full, sliding.
@pytest.mark.parametrize("name, stages", [("qwen3", 2), ("qwen3", 3), ("gemma", 2), ("qwen3-moe", 2),
                                          ("deepseek-v3", 3), ("gemma2", 2), ("gemma3", 3)])
def test_stages_greedy_equal_hf(families, name, stages):
    path, prompts, expected = families(name)
    llm = LLM(str(path), pipeline_parallel_size=stages, max_model_len=256, **SMALL)
    assert [o.outputs[0].token_ids for o in llm.generate(_ids(prompts), GREEDY)] == expected
    assert llm.engine.stats().num_preemptions > 0
    # Again, last first: the blocks freed last are still cached, so those prompts hit.
    again = llm.generate(_ids(prompts[::-1]), GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected[::-1]
    assert llm.engine.stats().pool.prefix_hits > 0
    assert [(s.start, s.stop) for s in llm.engine.runner.spans] == \
        [(s.start, s.stop) for s in split_layers(llm.engine.config.num_layers, stages)]
    if llm.engine.config.sliding_window is not None:  # every stage keeps the replica's two groups
        runners = [stage.runner for stage in llm.engine.runner.stages] + [llm.engine.runner.last]
        assert all(isinstance(r.kv, GroupedKV) and r.num_kv_groups == 2 for r in runners)


def test_tensor_parallel_stages_greedy_equal_hf(families):
    """Each stage's mesh: two devices (tensor parallel) per stage, the jnp path."""
    path, prompts, expected = families("qwen3")
    llm = LLM(str(path), pipeline_parallel_size=2, tensor_parallel_size=2, max_model_len=256, **SMALL)
    assert not llm.engine.runner.cpu_kernels and llm.engine.runner.last.mesh.devices.size == 2
    assert [o.outputs[0].token_ids for o in llm.generate(_ids(prompts), GREEDY)] == expected


def test_micro_batches_are_in_flight_together_with_disjoint_sequences(families):
    """The engine keeps one plan per stage in flight, each of different sequences."""
    path, prompts, expected = families("qwen3")
    llm = LLM(str(path), pipeline_parallel_size=2, pipeline_placement="local", num_kv_blocks=64)
    submitted, submit = [], llm.engine.runner.submit

    def spy(plan):
        held = [plan_sequences(p) for p, *_ in llm.engine.in_flight]
        submitted.append((held, plan_sequences(plan)))
        return submit(plan)

    llm.engine.runner.submit = spy
    assert [o.outputs[0].token_ids for o in llm.generate(_ids(prompts), GREEDY)] == expected
    together = [(held, new) for held, new in submitted if held]
    assert len(together) > NEW_TOKENS // 2  # most rounds start a plan while one is in flight
    assert all(new.isdisjoint(ids) for held, new in together for ids in held)


def test_grammars_logprobs_and_embeddings_run_on_the_last_stage(families):
    """What runs on the host beside sampling (grammar masks, logprobs) and the pooled hidden
    states of embeddings are the last stage's: the same as one replica holding every layer."""
    path, prompts, expected = families("qwen3")
    choice = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput.choice(["yes", "no"]))
    digits = SamplingParams(max_tokens=12, temperature=0, structured_output=StructuredOutput("regex", r"[0-9]{3}"))
    logprobs = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    results = []
    for stages in (1, 2):
        llm = LLM(str(path), pipeline_parallel_size=stages, pipeline_placement="local", num_kv_blocks=64)
        outs = llm.generate(_ids(prompts[:4]), [GREEDY, choice, digits, logprobs])
        results.append(([o.outputs[0].text for o in outs[1:3]], outs[3].outputs[0].logprobs,
                        llm.embed(_ids(prompts[1:3]))))
        assert outs[0].outputs[0].token_ids == expected[0] and outs[3].outputs[0].token_ids == expected[3]
    (texts, top, vectors), (texts2, top2, vectors2) = results
    assert texts == texts2 and texts[0] in ("yes", "no") and re.fullmatch(r"[0-9]{3}", texts[1])
    assert [sorted(step) for step in top] == [sorted(step) for step in top2]
    np.testing.assert_allclose(np.asarray(vectors2), np.asarray(vectors), rtol=1e-4, atol=1e-5)


def test_expert_load_counts_every_stage_layer(families):
    """Each stage counts its own sparse layers' routing; the engine reports them in layer order,
    as one replica holding every layer counts them."""
    path, prompts, _ = families("qwen3-moe")
    counts = []
    for stages in (1, 2):
        llm = LLM(str(path), pipeline_parallel_size=stages, pipeline_placement="local", num_kv_blocks=64)
        llm.generate(_ids(prompts), GREEDY)
        counts.append(llm.engine.runner.take_expert_load())
    assert counts[0].shape == counts[1].shape and (counts[0] == counts[1]).all()


def test_bundled_model_in_two_and_three_stages(bundled_path, hf_bundled_model, bundled_model):
    ids = bundled_model.tokenizer.encode("The capital of France is")
    expected = hf_greedy(hf_bundled_model, ids, NEW_TOKENS)
    for stages in (2, 3):
        llm = LLM(str(bundled_path), pipeline_parallel_size=stages, pipeline_placement="local",
                  max_num_batched_tokens=16, num_kv_blocks=64)
        assert llm.generate(_ids([ids]), GREEDY)[0].outputs[0].token_ids == expected


def test_lora_adapters_per_stage_match_merged_hf(tmp_path):
    """Each stage fills its LoRA slots with its own layers' part of the adapter."""
    path, hf = build_tiny_checkpoint("llama-gqa", tmp_path / "base")
    adapters = [write_adapter(tmp_path / f"a{i}", hf, 4, 8, list(MODULES), seed=i) for i in range(2)]
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (23, 5)]
    llm = LLM(str(path), pipeline_parallel_size=3, enable_lora=True, max_loras=2, max_lora_rank=8, **SMALL)
    requests = [None] + [LoRARequest(f"a{i}", i + 1, str(d)) for i, (d, _) in enumerate(adapters)]
    references = [hf] + [merged for _, merged in adapters]
    for request, reference in zip(requests, references):
        outputs = llm.generate(_ids(prompts), GREEDY, lora_request=request)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]


def test_a_stage_reads_only_its_own_tensors(bundled_path):
    """Loading by slice: a stage's file reads are its layers' tensors (the tied embedding on the
    first and last stages, the final norm's one vector everywhere), and what it holds is that."""
    whole = load_model(bundled_path, keep_blocks=True).params  # (blocks kept as stored, as served)
    for span in split_layers(30, 3):
        file = GGUFFile(bundled_path)
        _, params = load_gguf_checkpoint(file, keep_blocks=True, layers=range(span.start, span.stop))
        layers = {int(name.split(".")[1]) for name in file.read if name.startswith("blk.")}
        assert layers == set(range(span.start, span.stop))
        ends = span.is_first or span.is_last
        assert ("token_embd.weight" in file.read) == ends
        expected = weight_bytes(whole.layers[span.start:span.stop]) + weight_bytes(whole.final_norm)
        assert weight_bytes(params) == expected + (weight_bytes(whole.embed) if ends else 0)


@pytest.mark.parametrize("setting, message", [
    (dict(speculative=dict(method="ngram", num_speculative_tokens=2)), "speculative"),
    (dict(num_scheduler_steps=4), "num_scheduler_steps"),
    (dict(hidden_state_slots=1), "hidden_state_slots"),
    (dict(pipeline_parallel_size=4), "between 1 and the model's 3 layers"),
])
def test_refused_combinations_name_the_setting(tiny_gqa_model, setting, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_gqa_model, **{"pipeline_parallel_size": 2, "pipeline_placement": "local", **setting})


def test_a_budget_fits_every_stage_of_a_two_group_model(tmp_path):
    """Gemma 3's three layers (sliding, full, sliding) over three stages: two stages hold no
    full-attention layer, one no sliding layer. Each stage's pools have the replica's block
    counts, and each stage must fit the budget."""
    path, _ = build_tiny_checkpoint("gemma3", tmp_path / "m")
    config = load_model_info(str(path)).config
    stages = [config.layer_slice(s.start, s.stop, stage=True) for s in split_layers(config.num_layers, 3)]
    assert {tuple(map(len, s.kv_group_layers)) for s in stages} == {(0, 1), (1, 0)}
    budget = 1 << 20
    full, sliding = group_blocks_for_budget(largest_stage(config, 3), 16, jnp.float32, budget, 1.0, 40,
                                            stage_layers=stage_kv_group_layers(config, 3))
    assert sliding == 40
    for stage in stages:
        kv = GroupedKV.create(stage, (full, sliding), 16, jnp.float32)
        assert kv.full.k.shape[:2] == (len(stage.kv_group_layers[0]), full)
        assert sum(a.nbytes for a in jax.tree.leaves(kv)) <= budget
    assert any(sum(a.nbytes for a in jax.tree.leaves(GroupedKV.create(s, (full + 1, sliding), 16, jnp.float32)))
               > budget for s in stages)  # the full group took the rest


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]
