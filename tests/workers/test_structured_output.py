"""Structured output and logit_bias: the grammar compiler, the sampler's mask and bias, and the
engine on the bundled model (valid output; exact across batching, multi-step decode, prefix
caching and preemption; a free request's output unchanged by a constrained neighbour)."""

from __future__ import annotations

import asyncio
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from raylm.workers.core.grammar import GrammarCompiler, GrammarError, StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.async_engine import AsyncEngine
from raylm.workers.engine.llm import LLM
from raylm.workers.runner.grammar_masks import accepted_prefix, allow_all, fill_bitmask, fill_bitmasks_along
from raylm.workers.runner.sampler import build_sampling_batch, sample
from raylm.workers.wire.replica_protocol import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


def _matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "pets"} and isinstance(value["name"], str) and len(value["name"]) <= 20
            and isinstance(value["age"], int) and all(p in ("cat", "dog") for p in value["pets"])
            and len(value["pets"]) <= 3)


@pytest.fixture(scope="module")
def compiler(bundled_model):
    config = bundled_model.config
    return GrammarCompiler(bundled_model.tokenizer, config.vocab_size, frozenset(config.eos_token_ids))


# -- the grammar compiler -----------------------------------------------------------------------------
@pytest.mark.parametrize("output, problem", [
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), "json schema cannot be used: Invalid type: nonsense"),
    (StructuredOutput("json_schema", "{not json"), "json schema cannot be used"),
    (StructuredOutput("regex", "(a{3"), "unclosed counted repetition"),
    (StructuredOutput("grammar", "start: missing_rule"), 'unknown name: "missing_rule"'),
])
def test_a_grammar_that_cannot_compile_is_a_grammar_error_naming_the_problem(compiler, output, problem):
    with pytest.raises(GrammarError, match=re.escape(problem)) as err:
        compiler.prepare(output)
    assert "\n" not in str(err.value)


def test_matchers_are_independent_copies_of_one_compiled_grammar(compiler):
    choice = StructuredOutput.choice(["yes", "no"])
    a, b = compiler.matcher(choice), compiler.matcher(choice)
    tokenizer = compiler._tokenizer
    assert a.consume_tokens(tokenizer.encode("yes")) and a.is_stopped()
    assert not b.is_stopped()  # b did not see a's tokens
    mask = allow_all(1, compiler.vocab_size)
    fill_bitmask(b, mask, 0)
    t = np.arange(compiler.vocab_size)
    allowed = {tokenizer.decode([int(i)]) for i in np.nonzero((mask[0, t // 32] >> (t % 32)) & 1)[0]}
    assert allowed == {"y", "ye", "yes", "n", "no"}


def test_speculative_guesses_are_cut_where_the_grammar_refuses_and_masked_along_the_rest(compiler):
    phone = StructuredOutput("regex", PHONE)
    tokenizer = compiler._tokenizer
    good = tokenizer.encode("555-1234")
    matcher = compiler.matcher(phone)
    assert matcher.consume_tokens(good[:2])  # a row two tokens into its output
    guesses = good[2:5] + tokenizer.encode("x") + good[5:]
    assert accepted_prefix(matcher, guesses) == 3 and accepted_prefix(matcher, []) == 0
    masks = np.stack([allow_all(2, compiler.vocab_size)] * 4)
    fill_bitmasks_along(matcher, guesses[:3], masks, 1)
    for j in range(4):  # a fresh matcher fed the same tokens allows the same next tokens
        fresh = compiler.matcher(phone)
        assert fresh.consume_tokens(good[:2] + guesses[:j])
        expected = allow_all(1, compiler.vocab_size)
        fill_bitmask(fresh, expected, 0)
        assert (masks[j, 1] == expected[0]).all() and (masks[j, 0] == -1).all()
    assert accepted_prefix(matcher, good[2:]) == len(good) - 2  # the matcher was rolled back


def test_a_json_schema_keeps_its_property_order(compiler):
    """As OpenAI's strict mode: the properties come in the schema's order (here not the sorted one)."""
    tokenizer = compiler._tokenizer

    def accepts(text: str) -> bool:
        ids = tokenizer.encode(text)
        return compiler.matcher(StructuredOutput.json_schema(SCHEMA)).validate_tokens(ids) == len(ids)

    assert accepts('{"name": "Ann", "age": 31, "pets": ["cat"]}')
    assert not accepts('{"age": 31, "name": "Ann", "pets": ["cat"]}')


# -- the sampler ---------------------------------------------------------------------------------------
def _batch(params: list[SamplingParams], vocab: int, bitmask: np.ndarray | None = None):
    rows = [(p, 7, 0, [1], []) for p in params]
    return build_sampling_batch(rows, len(params), vocab, frozenset({0}), False, bitmask)


def test_the_bitmask_leaves_only_allowed_tokens_and_bias_shifts_logits():
    vocab = 100
    logits = jnp.asarray(np.random.RandomState(0).randn(3, vocab).astype(np.float32))
    best = int(jnp.argmax(logits[0]))
    mask = allow_all(3, vocab)
    mask[1] = 0
    mask[1, 41 // 32] |= 1 << (41 % 32)
    mask[1, 77 // 32] |= 1 << (77 % 32)
    greedy = SamplingParams(temperature=0)
    params = [SamplingParams(temperature=0, logit_bias={best: -100.0, 5: 100.0}), greedy,
              SamplingParams(temperature=1.0, seed=3)]
    s = _batch(params, vocab, mask)
    out = sample(logits, s, num_logprobs=0, with_penalties=False)
    assert int(out.tokens[0]) == 5  # +100 wins; the row's best token is pushed down
    assert int(out.tokens[1]) == (41 if logits[1, 41] > logits[1, 77] else 77)
    for seed in range(20):  # a sampled row only ever draws allowed tokens
        params[1] = SamplingParams(temperature=1.0, seed=seed)
        out = sample(logits, _batch(params, vocab, mask), num_logprobs=0, with_penalties=False)
        assert int(out.tokens[1]) in (41, 77)
    # Rows without bias or mask are untouched: the same tokens as a batch without either.
    plain = sample(logits, _batch([greedy, greedy, params[2]], vocab), num_logprobs=0, with_penalties=False)
    mixed = sample(logits, _batch([params[0], greedy, params[2]], vocab, allow_all(3, vocab)), num_logprobs=0,
                   with_penalties=False)
    assert [int(t) for t in plain.tokens[1:]] == [int(t) for t in mixed.tokens[1:]]


# -- the engine ------------------------------------------------------------------------------------------
def _chat(model, question: str) -> dict:
    return {"prompt_token_ids": model.tokenizer.encode_chat([{"role": "user", "content": question}])}


def _requests(model) -> tuple[list[dict], list[SamplingParams]]:
    prompts = [_chat(model, "Describe Ann, 31, who has two cats, as JSON."),
               _chat(model, "What is the capital of France?"),
               _chat(model, "Is the sky green? Answer yes or no."),
               _chat(model, "Give me a phone number."),
               _chat(model, "Tell me a story.")]
    params = [SamplingParams(max_tokens=60, temperature=0, structured_output=StructuredOutput.json_schema(SCHEMA)),
              SamplingParams(max_tokens=24, temperature=0),
              SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput.choice(["yes", "no"])),
              SamplingParams(max_tokens=16, temperature=0, structured_output=StructuredOutput("regex", PHONE)),
              SamplingParams(max_tokens=24, temperature=0, structured_output=StructuredOutput("json_object"))]
    return prompts, params


def _texts(outputs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def alone(bundled_model):
    """Each request of ``_requests`` run by itself: the reference the batched runs must match."""
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200)
    prompts, params = _requests(bundled_model)
    return [_texts(llm.generate([p], [s]))[0] for p, s in zip(prompts, params)]


def test_constrained_outputs_follow_their_grammars(alone):
    (schema_text, r1), _, (choice, r2), (phone, r3), (obj, r4) = alone
    assert _matches_schema(schema_text) and r1 == "stop"
    assert list(json.loads(schema_text)) == list(SCHEMA["properties"])  # the schema's order, not sorted
    assert choice in ("yes", "no") and r2 == "stop"
    assert re.fullmatch(PHONE, phone) and r3 == "stop"
    assert r4 == "length" or isinstance(json.loads(obj), dict)


@pytest.mark.parametrize("engine", [
    dict(),
    dict(num_scheduler_steps=4),  # free rows alone decode 4 steps a call; constrained rows force 1
    dict(num_kv_blocks=24, max_num_batched_tokens=64),  # preemption and chunked prompts
])
def test_constrained_and_free_requests_batch_exactly(bundled_model, alone, engine):
    llm = LLM(bundled_model, max_model_len=512, **{"num_kv_blocks": 200, **engine})
    prompts, params = _requests(bundled_model)
    assert _texts(llm.generate(prompts, params)) == alone
    assert _texts(llm.generate(prompts, params)) == alone  # again, from the prefix cache
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == stats.waiting == 0


def test_seeded_sampled_forks_each_follow_the_grammar(bundled_model):
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200)
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=11, structured_output=StructuredOutput("regex", PHONE))
    prompt = _chat(bundled_model, "Give me a phone number.")
    first = _texts(llm.generate([prompt], [params]))
    assert all(re.fullmatch(PHONE, text) for text, _ in first) and len({t for t, _ in first}) > 1
    assert _texts(llm.generate([prompt], [params])) == first  # seeded: reproducible


def test_logit_bias_bans_and_forces_tokens(bundled_model):
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200)
    prompt = _chat(bundled_model, "What is the capital of France?")
    free = llm.generate([prompt], [SamplingParams(max_tokens=8, temperature=0)])[0].outputs[0]
    banned = free.token_ids[0]
    out = llm.generate([prompt], [SamplingParams(max_tokens=8, temperature=0, logit_bias={banned: -100})])[0].outputs[0]
    assert out.token_ids[0] != banned and banned not in out.token_ids
    forced = bundled_model.tokenizer.encode(" banana")[0]
    out = llm.generate([prompt], [SamplingParams(max_tokens=4, temperature=0, logit_bias={forced: 100})])[0].outputs[0]
    assert out.token_ids == [forced] * 4


def test_bad_grammars_and_bias_ids_are_refused_before_they_run(bundled_model):
    async def main() -> None:
        engine = AsyncEngine.from_model(bundled_model, max_model_len=256, num_kv_blocks=64)
        try:
            bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json_schema", '{"type": "nonsense"}'))
            with pytest.raises(InvalidRequestError, match="Invalid type: nonsense"):
                async for _ in engine.generate([1, 2, 3], bad, "bad-grammar"):
                    pass
            with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
                async for _ in engine.generate([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}), "bad-bias"):
                    pass
            stats = await engine.stats()
            assert stats.pool.num_used_blocks == 0 and stats.requests == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
