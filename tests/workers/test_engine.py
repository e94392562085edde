"""The batching engine against the single-request reference loop, plus its output semantics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.serve.replica_metrics import EngineStatsReporter
from tests.checkpoints import build_tiny_checkpoint

NUM_PROMPTS = 32
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("engine") / "m")
    return load_model(path)


@pytest.fixture(scope="module")
def reference(tiny):
    return SingleSequenceGenerator(tiny.config, tiny.params)


@pytest.fixture(scope="module")
def workload(reference):
    """32 prompts of 1..300 tokens and their greedy continuations from the reference loop."""
    rng = np.random.RandomState(0)
    lengths = [1, 2, 15, 16, 17, 300] + rng.randint(1, 301, size=NUM_PROMPTS - 6).tolist()
    prompts = [rng.randint(3, 320, size=n).tolist() for n in lengths]
    return prompts, [list(reference.generate(p, NEW_TOKENS)) for p in prompts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, prompts, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_no_leak(llm: LLM):
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.pool.num_free_blocks == stats.pool.num_usable_blocks
    assert stats.tokens_stored == stats.token_capacity == 0


ENGINE_CONFIGS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    "multi-step-8": dict(num_scheduler_steps=8),
    "small-batches": dict(max_num_seqs=5, max_num_batched_tokens=48),
    "tensor-parallel-2": dict(tensor_parallel_size=2),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CONFIGS))
def test_greedy_equals_reference(tiny, workload, name):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=800, **ENGINE_CONFIGS[name])
    assert _run(llm, prompts) == expected
    _assert_no_leak(llm)


def test_greedy_exact_under_preemption(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=40, max_num_batched_tokens=64)
    assert _run(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    _assert_no_leak(llm)


def test_greedy_exact_with_prefix_cache_hits(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=800)
    assert _run(llm, prompts) == expected
    hits_before = llm.engine.stats().pool.prefix_hits
    # Same prompts again, plus shared-prefix variants: served from cached blocks, same tokens.
    assert _run(llm, prompts) == expected
    assert llm.engine.stats().pool.prefix_hits > hits_before
    _assert_no_leak(llm)


def test_n_greedy_forks_share_prompt_and_match(tiny, workload, reference):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=800)
    params = SamplingParams(n=3, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, want in zip(prompts[2:6], expected[2:6]):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs)
    _assert_no_leak(llm)


def test_n_sampled_completions_differ(tiny):
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=200)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(n=3, max_tokens=16, seed=3))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    _assert_no_leak(llm)


def test_seeded_request_is_batch_independent(tiny, workload):
    prompts, _ = workload
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=800)
    alone = _run(llm, [prompts[7]], params)[0]
    others = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:16]] + [{"prompt_token_ids": prompts[7]}],
        [others] * 16 + [params],
    )
    assert mixed[-1].outputs[0].token_ids == alone
    assert _run(llm, [prompts[7]], params)[0] == alone


def test_max_and_min_tokens_and_stop_token_ids(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=200)
    out = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected[3][:5] and out[0].outputs[0].finish_reason == "length"

    # The token greedy emits third ends generation there ...
    stop_token = expected[3][2]
    first = expected[3].index(stop_token)
    out = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]))
    completion = out[0].outputs[0]
    assert completion.token_ids == expected[3][: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token
    # ... but not before min_tokens: it is banned from sampling until then.
    out = llm.generate(
        [{"prompt_token_ids": prompts[3]}],
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token], min_tokens=first + 3),
    )
    tokens = out[0].outputs[0].token_ids
    assert stop_token not in tokens[: first + 3] and len(tokens) >= first + 3
    _assert_no_leak(llm)


def test_stop_strings_cut_text(bundled_model):
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200)
    prompt = "List the days of the week, one per line:"
    base = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\u2603"]))
    completion = out[0].outputs[0]
    assert completion.text == text[:cut] and completion.finish_reason == "stop" and completion.stop_reason == stop
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True))
    assert out[0].outputs[0].text == text[: cut + len(stop)]
    _assert_no_leak(llm)


def test_logprobs_match_float64_recomputation(tiny, reference, workload):
    prompts, _ = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=200)
    prompt = prompts[4]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=5))
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert token in entry and len(entry) <= 6
        top5 = sorted(entry.values(), reverse=True)[:5]
        assert sum(np.exp(top5)) <= 1.0 + 1e-5
        logits = reference.prompt_logits(prompt + completion.token_ids[:i])[-1].astype(np.float64)
        log_softmax = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        assert entry[token] == pytest.approx(log_softmax[token], abs=1e-4)
        total += entry[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_chat_and_string_prompts(bundled_model):
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200)
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=16, temperature=0))
    assert "Paris" in outs[0].outputs[0].text and outs[0].outputs[0].finish_reason in ("stop", "length")
    (out,) = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in out.outputs[0].text


def test_bad_requests(tiny):
    from raylm.model.errors import PromptTooLongError
    from raylm.workers.core.sampling_params import SamplingParamsError

    llm = LLM(tiny, max_model_len=128, num_kv_blocks=64)
    with pytest.raises(PromptTooLongError, match="maximum context is 128"):
        llm.generate([{"prompt_token_ids": [5] * 120}], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 100000]}])
    with pytest.raises(SamplingParamsError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(tiny, max_num_sequences=3)
    _assert_no_leak(llm)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_policy_preempts_lower_priority(tiny, workload, policy):
    prompts, expected = workload
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=200, max_num_seqs=2, scheduling_policy=policy).engine
    for i in (8, 9):
        engine.add_request(f"low{i}", prompts[i], GREEDY, priority=10)
    for _ in range(3):
        engine.step()
    engine.add_request("high", prompts[10], GREEDY, priority=0)
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    if policy == "priority":
        assert "high" in running and engine.scheduler.num_preemptions == 1
    else:
        assert "high" not in running and engine.scheduler.num_preemptions == 0
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    # Preempted requests recompute and still produce exactly the reference tokens.
    assert finished == {"low8": expected[8], "low9": expected[9], "high": expected[10]}


def test_work_tokens_count_what_is_left_to_compute_and_generate(tiny, workload):
    prompts, _ = workload
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64).engine
    engine.add_request("a", prompts[5][:80], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert engine.stats().work_tokens == 80 + 10  # waiting: the whole prompt and output budget
    engine.step()  # the prompt is computed and the first token sampled
    assert engine.stats().work_tokens == 1 + 9  # the sampled token's K/V, and 9 outputs left
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().work_tokens == 0


def _step_until_finished(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_prefix_lookup_counts_once_however_long_admission_waits(tiny):
    """Block size 16, 11 usable blocks. P (64 tokens) leaves 4 cached blocks. A (100 tokens)
    then holds 7 blocks, so B (P's prompt + 30 tokens: 4 cached blocks, 2 more to allocate)
    waits while only P's 4 cached blocks are free, and is looked up again every step."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=12).engine
    p_prompt = list(range(3, 67))
    engine.add_request("P", p_prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    _step_until_finished(engine)
    engine.add_request("A", list(range(100, 200)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.add_request("B", p_prompt + list(range(200, 230)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
        assert [s.request_id for s in engine.scheduler.waiting] == ["B"]
    finished = _step_until_finished(engine)
    stats = engine.stats()
    # Prompt tokens looked up, as vLLM counts them: P 64, A 100, B 94; only B hits, P's 4 blocks.
    assert (stats.pool.prefix_queries, stats.pool.prefix_hits) == (64 + 100 + 94, 4 * 16)
    assert finished["B"].num_cached_tokens == 4 * 16
    assert stats.pool.num_used_blocks == 0


class _CounterRecorder:
    """WorkerMetrics' ``inc`` and ``set``: what each counter would export."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}

    def set(self, name: str, value: float) -> None:
        pass

    def inc(self, name: str, value: float, **tags: str) -> None:
        if value > 0:  # as WorkerMetrics: a Ray counter takes only positive increments
            self.counters[name] = self.counters.get(name, 0) + value


def test_prefix_cache_counters_count_prompt_tokens_from_the_first_short_request(tiny):
    """As vLLM's: every prompt token looked up counts, so a prompt shorter than a block (16
    tokens) shows at once; a repeat of a 20-token prompt finds its one full block (16 tokens)."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64).engine
    recorder = _CounterRecorder()
    reporter = EngineStatsReporter(recorder)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("short", list(range(3, 8)), greedy)
    _step_until_finished(engine)
    reporter.report(engine.stats())
    assert recorder.counters == {"raylm_prefix_cache_queries_total": 5}
    for request_id in ("first", "again"):
        engine.add_request(request_id, list(range(10, 30)), greedy)
        _step_until_finished(engine)
    reporter.report(engine.stats())
    assert recorder.counters == {"raylm_prefix_cache_queries_total": 5 + 20 + 20, "raylm_prefix_cache_hits_total": 16}


def test_cached_tokens_count_the_first_admission_prompt_hit_after_preemption(tiny, reference):
    """A 20-token prompt whose first block (16 tokens) is cached runs 30 tokens, is preempted
    by a higher-priority request, and is readmitted with 3 cached blocks (48 tokens, more than
    its prompt): usage must still say 16 prompt tokens came from the cache."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=200, max_num_seqs=1, scheduling_policy="priority").engine
    prompt = list(range(7, 27))
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    _step_until_finished(engine)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("low", prompt, params, priority=10)
    for _ in range(30):
        engine.step()
    queries = engine.stats().pool.prefix_queries
    engine.add_request("high", list(range(300, 310)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finished = _step_until_finished(engine)
    assert engine.stats().num_preemptions == 1
    assert finished["low"].num_cached_tokens == 16
    # The readmission is no new lookup in the stats: only "high"'s 10 prompt tokens were.
    assert engine.stats().pool.prefix_queries == queries + 10
    assert finished["low"].outputs[0].token_ids == list(reference.generate(prompt, 40))


def test_a_steps_seconds_and_first_scheduled_time_cover_its_compute(tiny, monkeypatch):
    """The step counters' seconds (``raylm bench``'s GFLOP/s) and a request's first scheduled time
    (the queue-time and prefill-time metrics) are taken before the runner computes the step: a
    runner that takes 0.2 s a step shows 0.2 s a step, and the request was scheduled before it."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64).engine
    submit = engine.runner.submit

    def slow_submit(plan):
        time.sleep(0.2)
        return submit(plan)

    monkeypatch.setattr(engine.runner, "submit", slow_submit)
    engine.add_request("r", list(range(40, 60)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    before = time.monotonic()
    outputs = _step_until_finished(engine)
    kinds = engine.stats().compute.kinds
    steps = sum(k.steps for k in kinds.values())
    assert steps >= 3 and sum(k.seconds for k in kinds.values()) >= 0.2 * steps
    assert before <= outputs["r"].first_scheduled_time < before + 0.2


def test_a_request_finishing_at_its_first_token_leaves_its_prompt_cached(tiny):
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64).engine
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks of 16
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("first", prompt, one)
    _step_until_finished(engine)
    assert engine.stats().pool.num_cached_blocks == 2
    engine.add_request("again", prompt, one)
    assert _step_until_finished(engine)["again"].num_cached_tokens == 32


def test_a_sequence_longer_than_the_kv_pool_ends_at_its_capacity(tiny, reference):
    """4 usable blocks of 16 hold 64 tokens' K/V; the last sampled token needs none. A 10-token
    prompt asking for 100 tokens (the context allows 512) could never get a fifth block, and
    used to wait for it forever; it ends with "length" after 64 + 1 - 10 = 55 tokens."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=5).engine
    prompt = list(range(11, 21))
    engine.add_request("big", prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(200):  # 1 prefill + 54 decode steps are needed
        finished.update({out.request_id: out for out in engine.step() if out.finished})
        if not engine.has_unfinished_requests():
            break
    completion = finished["big"].outputs[0]
    assert completion.finish_reason == "length"
    assert completion.token_ids == list(reference.generate(prompt, 55))
    assert engine.stats().pool.num_used_blocks == 0


def test_without_chunked_prefill_a_preempted_sequence_recomputes_in_chunks(tiny, reference):
    """Budget 32 tokens, no chunked prefill, no prefix cache: a 30-token prompt fits one step,
    but preempted after 5 outputs it must recompute 35 tokens, more than any one step holds."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=32,
                 enable_chunked_prefill=False, enable_prefix_caching=False, scheduling_policy="priority").engine
    prompt = list(range(30, 60))
    engine.add_request("low", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), priority=5)
    for _ in range(5):
        engine.step()
    engine.add_request("high", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(100):  # high: 2 steps; low: 2 recompute chunks and 7 decodes
        finished.update({out.request_id: out for out in engine.step() if out.finished})
        if not engine.has_unfinished_requests():
            break
    assert engine.stats().num_preemptions == 1
    assert finished["low"].outputs[0].token_ids == list(reference.generate(prompt, 12))
    assert finished["high"].outputs[0].token_ids == list(reference.generate([4, 5, 6], 2))
