"""Beam search on the engine against a naive beam search over the reference loop's logits
(float64 log-softmax of each beam's full recomputation), and its bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import BeamSearchParams
from raylm.workers.engine.beam_search import Beam, BeamSearch
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("beam") / "m")
    return load_model(path)


def _naive_beam_search(reference: SingleSequenceGenerator, prompt: list[int], width: int, max_tokens: int,
                       eos: frozenset[int], length_penalty: float) -> list[tuple[list[int], float]]:
    """Expand every live beam by its top 2*width tokens, keep the best ``width`` by cumulative
    logprob; a candidate ending in EOS finishes. Each beam's logits come from recomputing it whole."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    while live:
        grown = []
        for tokens, cum in live:
            logits = reference.prompt_logits(prompt + tokens)[-1].astype(np.float64)
            logprobs = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            for token in np.argsort(-logprobs, kind="stable")[: 2 * width]:
                grown.append((tokens + [int(token)], cum + float(logprobs[token])))
        grown.sort(key=lambda b: -b[1])
        live, kept = [], 0
        for tokens, cum in grown:
            if kept == width:
                break
            if tokens[-1] in eos:
                finished.append((tokens, cum))
                continue
            kept += 1
            (finished if len(tokens) >= max_tokens else live).append((tokens, cum))
    score = lambda b: b[1] / max(1, len(b[0])) ** length_penalty  # noqa: E731
    return sorted(finished, key=lambda b: -score(b))[:width]


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.0)])
def test_beam_search_equals_a_naive_beam_search(tiny, width, length_penalty):
    reference = SingleSequenceGenerator(tiny.config, tiny.params)
    eos = frozenset(tiny.config.eos_token_ids)
    rng = np.random.RandomState(width)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (5, 17, 40)]
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=400)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, beams in zip(prompts, results):
        expected = _naive_beam_search(reference, prompt, width, 6, eos, length_penalty)
        assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
        np.testing.assert_allclose([b.cumulative_logprob for b in beams], [cum for _, cum in expected], atol=2e-4)
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.pool.prefix_hits > 0  # beams shared their prefixes


def test_eos_finishes_a_beam_and_width_caps_what_lives():
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5), eos_ids=frozenset({0}))
    search.advance([{0: -0.1, 5: -0.5, 6: -0.7, 7: -3.0}])
    assert search.finished == [Beam((0,), -0.1, "stop")]
    assert [b.tokens for b in search.live] == [(5,), (6,)]
    search.advance([{8: -1.0}, {9: -0.1, 10: -0.2}])
    assert [(b.tokens, round(b.cum_logprob, 3)) for b in search.live] == [((6, 9), -0.8), ((6, 10), -0.9)]
    assert [b.tokens for b in search.best()] == [(0,), (6, 9)]
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
