"""The speculative benchmark's step accounting and cost-model prediction, on hand-computed cases."""

import pytest

from raylm.benchmarks.speculative_bench import _step_mix, predicted_ratio


def test_step_mix_counts_plain_steps_and_verifies():
    # 2 requests, 20 tokens: 2 from the prefills, 18 decoded. 4 verifies accepted 6 guesses
    # (emitting 10 tokens), so 8 plain steps emitted the other 8: 12 steps for 18 tokens.
    mix = _step_mix(tokens=20, requests=2, accepted=6, verifies=4)
    assert mix == pytest.approx({"tokens_per_step": 18 / 12, "verify_share": 4 / 12})


def test_no_speculation_is_one_token_per_plain_step():
    assert _step_mix(tokens=10, requests=1, accepted=0, verifies=0) == {"tokens_per_step": 1.0, "verify_share": 0.0}


def test_predicted_ratio_weighs_verifies_and_draft_steps():
    costs = {"target": {1: 6.0, 4: 9.0}, "self-int8": {1: 2.0}}
    row = {"tokens_per_step": 2.0, "verify_share": 0.5}
    # n-gram: half the steps cost 9 ms, half 6 ms: 7.5 ms for 2 tokens, against 6 ms a token.
    assert predicted_ratio(row, costs, "ngram", 3) == pytest.approx(2 * 6 / 7.5)
    # A draft adds its k steps to every verify: 9 + 3 * 2 = 15 ms.
    assert predicted_ratio(row, costs, "self-int8", 3) == pytest.approx(2 * 6 / (0.5 * 15 + 0.5 * 6))
