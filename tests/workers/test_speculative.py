"""Speculative decoding: output with it is output without it, whatever the proposer guesses.

Greedy: token for token equal to the single-request reference loop over the 32-prompt
exactness workload (plus prompts that repeat themselves, so n-gram lookup finds matches),
for both proposers, k = 1, 3, 5, with mixed batches, prefix hits, preemption and n = 2.
Sampling: a seeded request gives the same tokens with speculation as without (the
acceptance rule samples the target's own token with the row's own random stream), and,
seeds aside, the joint distribution of the first three sampled tokens matches plain
decoding's over 20k samples (chi-square, fixed seeds, so deterministic).
"""

from __future__ import annotations

import collections
import json

import jax
import numpy as np
import pytest
import scipy.stats

from raylm.cache.block_pool import BlockPool
from raylm.cache.block_tables import BlockManager
from raylm.cache.kv_budget import bytes_per_block
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.scheduler import Scheduler, SchedulerConfig
from raylm.workers.core.sequence import Sequence
from raylm.workers.core.speculation import SpecDecodeStats, SpeculativeConfig, propose_ngram
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_gqa_path):
    return load_model(tiny_gqa_path)


@pytest.fixture(scope="module")
def workload(tiny):
    """32 random prompts of 1..300 tokens, 6 that repeat a short pattern, and their greedy
    continuations from the reference loop."""
    rng = np.random.RandomState(0)
    lengths = [1, 2, 15, 16, 17, 300] + rng.randint(1, 301, size=26).tolist()
    prompts = [rng.randint(3, 320, size=n).tolist() for n in lengths]
    prompts += [(rng.randint(3, 320, size=period).tolist() * 40)[:length]
                for period, length in ((2, 9), (3, 30), (5, 64), (7, 100), (4, 17), (6, 250))]
    reference = SingleSequenceGenerator(tiny.config, tiny.params)
    return prompts, [list(reference.generate(p, NEW_TOKENS)) for p in prompts]


def _run(llm: LLM, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.pool.num_free_blocks == stats.pool.num_usable_blocks


def _spec_stats(llm: LLM) -> SpecDecodeStats:
    return llm.engine.scheduler.spec_stats


# -- greedy exactness ---------------------------------------------------------------------------------
# k = 3 runs in the tests below (mixed steps, prefix hits and forks, preemption, sampling).
SPEC_CONFIGS = {
    "ngram k=1": dict(method="ngram", num_speculative_tokens=1),
    "ngram k=5": dict(method="ngram", num_speculative_tokens=5, ngram={"min": 2, "max": 5}),
    "1-layer draft k=1": dict(method="draft", num_layers=1, num_speculative_tokens=1),
    "1-layer draft k=5": dict(method="draft", num_layers=1, num_speculative_tokens=5),
    "int8 self-draft k=3": dict(method="draft", quantization="int8", num_speculative_tokens=3),
}


@pytest.mark.parametrize("spec", sorted(SPEC_CONFIGS))
def test_greedy_output_equals_reference(tiny, workload, spec):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900, speculative=SPEC_CONFIGS[spec])
    assert _run(llm, prompts) == expected
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > 0
    if spec.startswith("ngram"):
        assert stats.num_accepted_tokens > 0  # the repeating prompts
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_exact_when_steps_with_and_without_guesses_mix(tiny, workload, method):
    """Above 4 decoding sequences a step carries no guesses; small batches and chunks make both
    kinds of step alternate, and a draft's pool must stay in step through both."""
    prompts, expected = workload
    spec = dict(method=method, num_speculative_tokens=3, disable_by_batch_size=4,
                **({"num_layers": 1} if method == "draft" else {}))
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900, max_num_seqs=8, max_num_batched_tokens=48,
              speculative=spec)
    assert _run(llm, prompts) == expected
    assert _spec_stats(llm).num_draft_tokens > 0
    _assert_no_leak(llm)


def test_a_draft_equal_to_the_target_accepts_everything(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900,
              speculative=dict(method="draft", num_layers=tiny.config.num_layers, num_speculative_tokens=3))
    assert _run(llm, prompts) == expected
    stats = _spec_stats(llm)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.accepted_per_pos[0] == stats.num_drafts
    _assert_no_leak(llm)


def test_a_draft_model_in_memory_is_used_as_given(tiny, workload):
    """Offline, ``model`` may be a LoadedModel (a training script's draft): here the target
    itself, so every guess is accepted."""
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900,
              speculative=dict(method="draft", model=tiny, num_speculative_tokens=2))
    assert llm.engine.draft_model is tiny
    assert _run(llm, prompts) == expected
    stats = _spec_stats(llm)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    _assert_no_leak(llm)


def test_an_unrelated_draft_accepts_little_and_output_still_matches(tiny, workload, tmp_path):
    prompts, expected = workload
    other, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "draft", seed=7, num_hidden_layers=1)
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900,
              speculative=dict(method="draft", model=str(other), num_speculative_tokens=3))
    assert _run(llm, prompts) == expected
    assert _spec_stats(llm).acceptance_rate < 0.3
    _assert_no_leak(llm)


def test_greedy_exact_under_preemption(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=48, max_num_batched_tokens=64,
              speculative=dict(method="draft", num_layers=1, num_speculative_tokens=3))
    assert _run(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    _assert_no_leak(llm)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")
def test_greedy_exact_with_tensor_parallelism(tiny, workload):
    """TP=2: target and draft sharded, attention on the jnp path (no CPU kernels in a sharded
    program), so the draft's and the verify's multi-token rows run there too."""
    prompts, expected = workload
    chosen = [0, 1, 2, 5, 7, 30, 32, 33, 35, 37]
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900, tensor_parallel_size=2,
              speculative=dict(method="draft", num_layers=1, num_speculative_tokens=3))
    assert not llm.engine.runner.cpu_kernels
    assert _run(llm, [prompts[i] for i in chosen]) == [expected[i] for i in chosen]
    assert _spec_stats(llm).num_accepted_tokens > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_exact_with_prefix_hits_and_forks(tiny, workload, method):
    prompts, expected = workload
    spec = dict(method=method, num_speculative_tokens=3, **({"num_layers": 1} if method == "draft" else {}))
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900, speculative=spec)
    assert _run(llm, prompts) == expected
    hits = llm.engine.stats().pool.prefix_hits
    assert _run(llm, prompts) == expected  # from cached blocks (and the draft's pool beside them)
    assert llm.engine.stats().pool.prefix_hits > hits
    two = SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, want in zip(prompts[-6:], expected[-6:]):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], two)
        assert [c.token_ids for c in out.outputs] == [want, want]
    _assert_no_leak(llm)


def test_stops_and_max_tokens_inside_an_accepted_run(tiny, workload):
    """An accepted run is cut at a stop token or max_tokens; nothing past it is emitted."""
    prompts, expected = workload
    full = LLM(tiny, max_model_len=512, num_kv_blocks=900,
               speculative=dict(method="draft", num_layers=tiny.config.num_layers, num_speculative_tokens=3))
    for prompt, want in zip(prompts[:8], expected[:8]):
        stop = want[6]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
        (out,) = full.generate([{"prompt_token_ids": prompt}], params)
        assert out.outputs[0].token_ids == want[: want.index(stop) + 1]
        assert out.outputs[0].finish_reason == "stop"
        for max_tokens in (1, 2, 7):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            (out,) = full.generate([{"prompt_token_ids": prompt}], params)
            assert out.outputs[0].token_ids == want[:max_tokens]
    _assert_no_leak(full)


def test_stop_strings_inside_an_accepted_run(tiny, workload):
    """A stop string completed mid-run ends the output where plain decoding ends it: same
    tokens, same text cut before the stop string."""
    prompts, expected = workload
    plain = LLM(tiny, max_model_len=512, num_kv_blocks=900)
    full = LLM(tiny, max_model_len=512, num_kv_blocks=900,
               speculative=dict(method="draft", num_layers=tiny.config.num_layers, num_speculative_tokens=5))
    stopped = 0
    for prompt, want in zip(prompts[:10], expected[:10]):
        text = tiny.tokenizer.decode(want)
        stop = text[len(text) // 3 : len(text) // 3 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[stop], ignore_eos=True)
        ((a,), (b,)) = (llm.generate([{"prompt_token_ids": prompt}], params) for llm in (plain, full))
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason) == (
            a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason)
        stopped += a.outputs[0].finish_reason == "stop"
    assert stopped >= 5 and _spec_stats(full).num_accepted_tokens > 0
    _assert_no_leak(full)


def test_logprobs_are_the_targets(tiny, workload):
    prompts, _ = workload
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    plain = LLM(tiny, max_model_len=512, num_kv_blocks=900).generate(
        [{"prompt_token_ids": p} for p in prompts[:6]], params)
    spec = LLM(tiny, max_model_len=512, num_kv_blocks=900,
               speculative=dict(method="draft", num_layers=1, num_speculative_tokens=3)).generate(
        [{"prompt_token_ids": p} for p in prompts[:6]], params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([x[t] for t in x], [y[t] for t in x], atol=1e-5)


# -- sampling --------------------------------------------------------------------------------------------
SAMPLED = [
    SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.2, top_k=20, min_p=0.05, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, seed=13, min_tokens=10, stop_token_ids=[5], ignore_eos=True),
]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_request_samples_the_same_tokens_with_speculation(tiny, workload, method):
    prompts, _ = workload
    chosen = prompts[2:6] + prompts[-3:]
    rows = [(p, s) for p in chosen for s in SAMPLED]
    plain = LLM(tiny, max_model_len=512, num_kv_blocks=900)
    spec = dict(method=method, num_speculative_tokens=3,
                **({"num_layers": tiny.config.num_layers} if method == "draft" else {}))
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=900, speculative=spec)
    want = plain.generate([{"prompt_token_ids": p} for p, _ in rows], [s for _, s in rows])
    got = llm.generate([{"prompt_token_ids": p} for p, _ in rows], [s for _, s in rows])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert _spec_stats(llm).num_accepted_tokens > 0
    _assert_no_leak(llm)


def test_sampled_distribution_matches_plain_decoding(tiny):
    """20k samples of the first three tokens (top_k=3 keeps the joint support at <= 27) by plain
    decoding and with speculation, with different seeds: a two-sample chi-square test must not
    tell them apart."""
    prompt = [{"prompt_token_ids": [7, 8, 9, 10, 11]}]
    requests, n = 250, 80

    def joint(speculative, seed):
        llm = LLM(tiny, max_model_len=64, num_kv_blocks=1200, max_num_seqs=256, seed=seed,
                  speculative=speculative)
        counts = collections.Counter()
        params = SamplingParams(n=n, max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
        for out in llm.generate(prompt * requests, params):
            counts.update(tuple(c.token_ids) for c in out.outputs)
        return llm, counts

    _, plain = joint(None, seed=1)
    # The target itself as the draft: its argmax is accepted with the probability sampling
    # gives it, so both outcomes of the acceptance rule occur.
    llm, spec = joint(dict(method="draft", num_layers=tiny.config.num_layers, num_speculative_tokens=3), seed=2)
    stats = _spec_stats(llm)
    assert 0.05 < stats.acceptance_rate < 0.95  # both branches of the acceptance rule ran
    keys = sorted(set(plain) | set(spec))
    table = np.array([[plain[k] for k in keys], [spec[k] for k in keys]])
    assert table.sum() == 2 * requests * n
    _, p_value, _, _ = scipy.stats.chi2_contingency(table)
    assert p_value > 0.01, (p_value, dict(zip(keys, table.T.tolist())))
    _assert_no_leak(llm)


# -- scheduling ------------------------------------------------------------------------------------------
def _decoding(prompt_len: int, max_tokens: int, blocks: BlockManager) -> Sequence:
    """A sequence past its prompt (computed, in its blocks), one sampled token not yet computed."""
    seq = Sequence("r", 0, list(range(3, 3 + prompt_len)), GREEDY, seed=0, max_tokens=max_tokens)
    blocks.grow(seq, prompt_len)
    seq.num_computed_tokens = prompt_len
    seq.output_ids = [7]
    return seq


def _scheduler(usable_blocks: int) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(BlockPool(num_blocks=usable_blocks + 1, block_size=4, enable_prefix_caching=False))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, num_speculative_tokens=3)
    return Scheduler(config, blocks), blocks


def test_guesses_get_blocks_up_to_what_max_tokens_can_emit():
    scheduler, blocks = _scheduler(usable_blocks=4)
    a, b = _decoding(4, 20, blocks), _decoding(3, 3, blocks)
    scheduler.running += [a, b]
    plan = scheduler.schedule()
    # a: its last token at position 4 and 3 guesses at 5..7 (a second block); b: max_tokens 3
    # leaves 2 tokens to emit, so 1 guess (position 4: a second block).
    assert plan.guesses == {a.seq_id: 3, b.seq_id: 1}
    assert (len(a.block_ids), len(b.block_ids)) == (2, 2)


def test_guesses_never_cost_a_preemption():
    """A row whose guesses do not fit decodes without them instead of evicting another sequence."""
    scheduler, blocks = _scheduler(usable_blocks=4)
    # Each one's last token fits its last block; its guesses need one more. One block is free.
    a, b = _decoding(3, 20, blocks), _decoding(7, 20, blocks)
    scheduler.running += [a, b]
    plan = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and scheduler.waiting == []
    assert [d.row.seq_id for d in plan.decodes] == [a.seq_id, b.seq_id]
    assert plan.guesses == {a.seq_id: 3}  # a came first and took the free block; b decodes plainly
    assert blocks.pool.num_free_blocks == 0


# -- step counters ------------------------------------------------------------------------------------------
def test_each_step_counts_its_kind_tokens_and_the_operations_of_target_and_draft(tiny):
    """workers/engine/step_work.py over steps shaped by hand (16-token budget, a 1-layer draft, k = 2):
    each step adds one step of its kind, the target's tokens, and the operations of the runs
    of positions the target and the draft computed (model/decoder/flop_count.py counts a run)."""
    engine = LLM(tiny, max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=16,
                 speculative=dict(method="draft", num_layers=1, num_speculative_tokens=2)).engine
    target, draft = engine.step_counters.target, engine.step_counters.draft
    assert draft.matrix_params * 3 == target.matrix_params  # 1 of the 3 layers

    def ops(model, logit_rows, runs):
        return model.flops(logit_rows, np.array([s for s, _ in runs]), np.array([n for _, n in runs]))

    def step(kind, tokens, flops, request=None):
        if request is not None:
            engine.add_request(*request)
        before = engine.stats().compute.kinds
        engine.step()
        stats = engine.stats()
        after = stats.compute.kinds
        assert stats.compute.integer_matmuls is False
        assert (after[kind].steps - before[kind].steps, after[kind].tokens - before[kind].tokens,
                after[kind].flops - before[kind].flops) == (1, tokens, flops)
        assert after[kind].seconds > before[kind].seconds
        assert all(after[k] == before[k] for k in after if k != kind)
        assert type(stats).from_dict(stats.as_dict()) == stats  # as it crosses Ray

    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    # A's 20-token prompt in two chunks; the draft computes them too (its logits are not counted).
    step("prefill", 16, ops(target, 1, [(0, 16)]) + ops(draft, 0, [(0, 16)]), ("a", list(range(3, 23)), params(2)))
    step("prefill", 4, ops(target, 1, [(16, 4)]) + ops(draft, 0, [(16, 4)]))
    # A may emit one token more, so it decodes with no guesses (the draft computes its window)
    # beside B's whole prompt.
    step("mixed", 11, ops(target, 2, [(20, 1), (0, 10)]) + ops(draft, 1, [(20, 1), (0, 10)]),
         ("b", list(range(30, 40)), params(4)))
    # B's last token and 2 guesses are verified; the draft computed the token and its first guess.
    step("verify", 3, ops(target, 3, [(10, 3)]) + ops(draft, 2, [(10, 1), (11, 1)]))
    assert engine.stats().spec.num_draft_tokens == 2
    while engine.has_unfinished_requests():
        engine.step()
    step("prefill", 5, ops(target, 1, [(0, 5)]) + ops(draft, 0, [(0, 5)]), ("c", list(range(50, 55)), params(2)))
    step("decode", 1, ops(target, 1, [(5, 1)]) + ops(draft, 1, [(5, 1)]))


# -- settings and the n-gram proposer ----------------------------------------------------------------------
def test_propose_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 2, 3], 2, 1, 3) == [4, 2]
    assert propose_ngram([5, 6, 7], 3, 1, 3) == []
    assert propose_ngram([4, 4, 4, 4], 5, 1, 2) == [4]  # only what follows exists
    assert propose_ngram([1, 2, 9, 2], 2, 2, 3) == []  # a 1-token match does not count below min
    assert propose_ngram([3], 2, 1, 1) == []


def test_settings_are_validated_with_their_names(tiny):
    assert SpeculativeConfig.parse({"method": "ngram", "ngram": {"min": 2, "max": 3}}).ngram_max == 3
    for bad, words in [
        ({"method": "eagle"}, "speculative.method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "ngram": {"min": 3, "max": 2}}, "min <= max"),
        ({"method": "ngram", "ngram": {"mean": 3}}, "speculative.ngram"),
        ({"method": "ngram", "model": "x"}, "takes no draft model"),
        ({"typo": 1}, "unknown speculative setting"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(speculative={"method": "ngram"}, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="no draft ships"):
        LLM(tiny, num_kv_blocks=64, speculative={"method": "draft"})
    with pytest.raises(ValueError, match="cannot be cut"):
        LLM(tiny, num_kv_blocks=64, speculative={"method": "draft", "num_layers": 9})


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(tiny, tmp_path):
    other, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "draft", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens.*has 320"):
        LLM(tiny, num_kv_blocks=64, speculative={"method": "draft", "model": str(other)})


def test_the_draft_pool_shares_the_kv_budget(tiny):
    budget = 1 << 22
    plain = LLM(tiny, kv_cache_memory_bytes=budget)
    cut = LLM(tiny, kv_cache_memory_bytes=budget, speculative={"method": "draft", "num_layers": 1})
    per_layer = bytes_per_block(tiny.config, 16, np.float32) // tiny.config.num_layers
    assert plain.engine.pool.num_blocks == budget // (per_layer * tiny.config.num_layers)
    assert cut.engine.pool.num_blocks == budget // (per_layer * (tiny.config.num_layers + 1))
    assert cut.engine.runner.draft.kv.k.shape[:2] == (1, cut.engine.pool.num_blocks)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_no_compilation_after_warmup(tiny, workload, compilations, method):
    prompts, expected = workload
    spec = dict(method=method, num_speculative_tokens=3, disable_by_batch_size=4,
                **({"num_layers": 1} if method == "draft" else {}))
    llm = LLM(tiny, max_model_len=512, num_kv_blocks=400, warmup=True, max_num_seqs=4, max_num_batched_tokens=32,
              speculative=spec)
    assert compilations, "warm-up compiled nothing?"
    compilations.clear()
    assert _run(llm, prompts[-6:]) == expected[-6:]
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)
    _run(llm, prompts[-3:] + prompts[:1], sampled)
    assert compilations == []


# -- the bundled model's shipped draft ------------------------------------------------------------------
def test_the_bundled_models_shipped_draft_serves_the_same_tokens(bundled_model):
    """``method: draft`` with nothing else named: the bundled model's int8 copy proposes, and the
    float32 model's greedy answers come out unchanged, most guesses accepted."""
    tok = bundled_model.tokenizer
    prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": text}], True)}
               for text in ("What is the capital of France?", "Count from 1 to 20.")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # The pool of the structured-output tests below: their plain engine reuses these programs.
    plain = LLM(bundled_model, max_model_len=256, num_kv_blocks=200).generate(prompts, params)
    llm = LLM(bundled_model, max_model_len=256, num_kv_blocks=200, speculative={"method": "draft"})
    draft = llm.engine.runner.draft
    assert draft.config.num_layers == bundled_model.config.num_layers
    assert llm.engine.draft_model.quantization == "int8"
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert _spec_stats(llm).acceptance_rate > 0.6
    with pytest.raises(ValueError, match="already served int8.*method: ngram"):
        LLM(bundled_model, quantization="int8", num_kv_blocks=64, speculative={"method": "draft"})
    # Served as GGUF blocks (the CPU default), the int8 copy reads more bytes than the model.
    with pytest.raises(ValueError, match="served as GGUF blocks.*0.71x.*method: ngram.*gguf_blocks: expand"):
        LLM(DEFAULT_MODEL, gguf_blocks="keep", num_kv_blocks=64, speculative={"method": "draft"})


@pytest.fixture(scope="module")
def structured_requests(bundled_model):
    """Two constrained and two free chat requests, and plain decoding's answers (the reference of
    both proposers' runs below)."""
    from raylm.workers.core.grammar import StructuredOutput

    chat = lambda q: {"prompt_token_ids": bundled_model.tokenizer.encode_chat([{"role": "user", "content": q}])}  # noqa: E731
    prompts = [chat("Describe Ann, 31, as JSON."), chat("Count from 1 to 20, separated by commas."),
               chat("Repeat this phone number: 555-1234, 555-1234."),
               chat("Repeat after me: the cat sat on the mat, the cat sat on the mat.")]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput.json_schema(schema)),
              SamplingParams(max_tokens=40, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, structured_output=StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}")),
              SamplingParams(max_tokens=40, temperature=0)]
    return prompts, params, LLM(bundled_model, max_model_len=256, num_kv_blocks=200).generate(prompts, params)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_structured_output_rows_decode_exactly_beside_speculating_rows(bundled_model, structured_requests, method):
    """Constrained rows speculate too: their guesses are checked against their grammar (the
    ones it refuses dropped) and each verified position is sampled under the grammar's mask
    after the guesses before it. Every row's greedy output equals plain decoding's, batched
    with free rows or alone, and the constrained rows alone still have guesses accepted."""
    prompts, params, plain = structured_requests
    spec = dict(method="ngram", num_speculative_tokens=3) if method == "ngram" else \
        dict(method="draft", num_layers=2, num_speculative_tokens=3)
    llm = LLM(bundled_model, max_model_len=256, num_kv_blocks=200, speculative=spec)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert set(json.loads(out[0].outputs[0].text)) == {"name", "age"}
    assert _spec_stats(llm).num_draft_tokens > 0  # the free rows did speculate
    _assert_no_leak(llm)

    # Alone, with a draft as deep as the target (the 2-layer one's JSON guesses all fail):
    # every guess the grammar accepts is the target's own token, so each must be accepted.
    constrained = [0, 2]
    if method == "draft":
        spec = dict(spec, num_layers=bundled_model.config.num_layers)
    alone = LLM(bundled_model, max_model_len=256, num_kv_blocks=200, speculative=spec)
    out = alone.generate([prompts[i] for i in constrained], [params[i] for i in constrained])
    assert [o.outputs[0].token_ids for o in out] == [plain[i].outputs[0].token_ids for i in constrained]
    stats = _spec_stats(alone)
    assert stats.num_accepted_tokens > 0, stats
    if method == "draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    _assert_no_leak(alone)
