"""A mesh over two processes (``jax.distributed``, gloo collectives on CPU): TP=2 with one CPU
device per process serves the greedy tokens of HF's model, of one process at TP=1 and of one
process at TP=2 over two forced host devices, on a mixed batch with chunked prefill and a
prefix cache hit; experts split over the processes, and a model with sliding-window layers, give one
process's tokens; and what it does not support is refused, saying so."""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket

import jax
import numpy as np
import pytest
import transformers

from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import make_engine
from raylm.workers.engine.multihost_engine import MultiHostEngine
from raylm.workers.runner.batch_inputs import sampling_inputs
from raylm.workers.runner.multihost import follower_plan
from tests.checkpoints import build_tiny_checkpoint
from tests.multihost_leader import lead
from tests.reference import hf_greedy

NEW_TOKENS = 10
# Small steps: the 40-token prompts go in chunks of 16 beside the others' decodes.
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("multihost") / "m")  # 4 heads, 2 KV heads
    return path


def _prompts() -> list[list[int]]:
    """Four lengths; the last shares the third's first 32 tokens (4 blocks: a prefix cache hit)."""
    long = [(7 * i) % 300 + 3 for i in range(40)]
    return [[5, 9, 11], [(3 * i) % 300 + 3 for i in range(17)], long, long[:32] + [17, 19, 23, 29, 31]]


def _greedy(engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update((out.request_id, list(out.outputs[0].token_ids)) for out in engine.step() if out.finished)
    return [tokens[str(i)] for i in range(len(_prompts()))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(checkpoint, layout: dict) -> dict:
    """The leader (tests/multihost_leader.py) and its follower, each a fresh process with one device."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    args = dict(ENGINE, num_hosts=2, **layout)
    leader = context.Process(target=lead, args=(theirs, str(checkpoint), args, f"127.0.0.1:{_free_port()}",
                                                _prompts(), NEW_TOKENS))
    leader.start()
    try:
        assert mine.poll(120), "the leader sent nothing in 120 s"
        return mine.recv()
    finally:
        leader.join(30)
        if leader.is_alive():
            leader.kill()


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")
def test_tp2_over_two_processes_equals_one_process(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="float32")
    expected = [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in _prompts()]
    model = load_model(checkpoint)
    assert _greedy(make_engine(model, **ENGINE)) == expected  # one process, TP=1
    assert _greedy(make_engine(model, tensor_parallel_size=2, **ENGINE)) == expected  # one process, 2 devices
    # Two processes, each program compiled at first use (tests/cluster/test_multihost_ray.py warms up).
    result = _two_processes(checkpoint, dict(tensor_parallel_size=2))
    assert result["tokens"] == expected
    assert "logits processors" in result["refusal"] and "num_hosts=2" in result["refusal"]
    relay_s = sorted(result["relay_s"])
    print(f"pipe relay per launch: median {relay_s[len(relay_s) // 2] * 1e3:.3f} ms, max {relay_s[-1] * 1e3:.3f} ms")


@pytest.mark.parametrize("variant,layout", [
    # Experts split over the two processes, four decode steps per call.
    ("qwen3-moe", dict(expert_parallel_size=2, num_scheduler_steps=4)),
    # Sliding and full-attention layers with pools of their own (two block counts relayed).
    ("gemma3", dict(tensor_parallel_size=2)),
])
def test_more_layouts_over_two_processes_equal_one_process(tmp_path, variant, layout):
    path, _ = build_tiny_checkpoint(variant, tmp_path / variant)
    one_device = {k: v for k, v in layout.items() if not k.endswith("parallel_size")}
    expected = _greedy(make_engine(load_model(path), **ENGINE, **one_device))
    assert _two_processes(path, layout)["tokens"] == expected


def test_what_a_mesh_over_hosts_refuses(checkpoint):
    for refused, name in [(dict(enable_lora=True), "enable_lora"), (dict(hidden_state_slots=1), "hidden_state_slots"),
                          (dict(speculative={"method": "ngram", "num_speculative_tokens": 2}), "speculative")]:
        with pytest.raises(ValueError, match=f"num_hosts=2: a mesh over several hosts does not support {name} yet"):
            EngineArgs(tensor_parallel_size=2, num_hosts=2, **refused)
    with pytest.raises(ValueError, match="num_hosts=2 must divide tensor x expert parallel = 3"):
        EngineArgs(tensor_parallel_size=3, num_hosts=2)
    with pytest.raises(ValueError, match="num_hosts must be an integer >= 1"):
        EngineArgs(num_hosts=0)
    model = load_model(checkpoint)
    # One process that did not join a group of two, and a plain engine asked for two hosts.
    with pytest.raises(ValueError, match="num_hosts=2 but 1 process"):
        MultiHostEngine(model, EngineArgs(tensor_parallel_size=2, num_hosts=2, **ENGINE), relay=None)
    with pytest.raises(ValueError, match="MultiHostEngine"):
        make_engine(model, tensor_parallel_size=2, num_hosts=2, **ENGINE)


def test_follower_plans_build_the_leaders_sampling_inputs_without_the_contexts(checkpoint):
    """Each step's plan as relayed drops the rows' token lists unless penalties read them, and
    the sampling batch built from it is the leader's, array for array."""
    engine = make_engine(load_model(checkpoint), **ENGINE)
    prompt = [(5 * i) % 300 + 3 for i in range(60)]
    engine.add_request("plain", prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=1, min_tokens=3))
    engine.add_request("penalized", prompt[:50], SamplingParams(max_tokens=6, repetition_penalty=1.3,
                                                                frequency_penalty=0.5))
    steps = 0
    while engine.scheduler.running or engine.scheduler.waiting:
        plan = engine.scheduler.schedule()
        relayed = follower_plan(plan)
        leader_rows = [c.row for c in plan.prefills] + [d.row for d in plan.decodes]
        relayed_rows = [c.row for c in relayed.prefills] + [d.row for d in relayed.decodes]
        for leader, follower in zip(leader_rows, relayed_rows, strict=True):
            kept = leader.request_id == "penalized"
            assert (list(follower.prompt_ids) == list(leader.prompt_ids)) if kept else follower.prompt_ids == ()
            assert len(follower.output_ids) == len(leader.output_ids)
        built = [sampling_inputs(rows, 4, 320, engine.eos_ids) for rows in (leader_rows, relayed_rows)]
        assert built[0][1] == built[1][1]  # the program's flags
        for field in dataclasses.fields(built[0][0]):
            a, b = (getattr(batch, field.name) for batch, _ in built)
            assert (a is None and b is None) or np.array_equal(a, b), field.name
        output = engine.runner.execute(plan)
        engine.scheduler.update_from_output(plan, output, 0.0)
        steps += 1
    assert steps >= 6  # prompt chunks, then decodes with outputs to count


def test_follower_plan_refuses_rows_that_need_the_host(checkpoint):
    engine = make_engine(load_model(checkpoint), **ENGINE)
    engine.add_request("p", [5, 9, 11], SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits]))
    plan = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="request 'p': structured output and logits processors are not supported"):
        follower_plan(plan)
