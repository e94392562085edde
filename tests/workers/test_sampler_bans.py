"""The sampler's min_tokens bans, hand-computed: a row below its min_tokens never draws a stop
id, a row past it (or without one) is untouched, duplicates and id 0 included."""

from __future__ import annotations

import jax
import numpy as np

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.runner.sampler import build_sampling_batch, sample

VOCAB = 40


def _tokens(logits: np.ndarray, params: list[SamplingParams], output_index: list[int]) -> list[int]:
    rows = [(p, 0, i, [1], [5] * i) for p, i in zip(params, output_index)]
    batch = build_sampling_batch(rows, len(rows), VOCAB, frozenset({0, 7}), False)
    program = jax.jit(lambda l, s: sample(l, s, num_logprobs=0, with_penalties=False).tokens)
    return np.asarray(program(logits, batch)).tolist()


def test_stop_ids_are_banned_only_below_min_tokens():
    logits = np.zeros((4, VOCAB), np.float32)
    logits[:, 7] = 9.0  # an EOS id, the favourite everywhere
    logits[:, 0] = 8.0  # the other EOS id, second
    logits[:, 12] = 7.0
    logits[:, 30] = 6.0
    logits[3, 12] = np.nan  # a row whose best non-stop token is NaN: NaN still wins, as in argmax
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[12, 12]),  # bans 0, 7, 12
        SamplingParams(temperature=0.0, min_tokens=3),  # past its minimum below: untouched
        SamplingParams(temperature=0.0),  # no minimum
        SamplingParams(temperature=0.0, min_tokens=1),
    ]
    assert _tokens(logits, params, [0, 3, 0, 0]) == [30, 7, 7, 12]


def test_ignore_eos_leaves_eos_ids_free_but_bans_stop_ids():
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, [7, 20, 21]] = [9.0, 8.0, 1.0]
    params = [SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[20])]
    assert _tokens(logits, params, [0]) == [7]
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20])]
    assert _tokens(logits, params, [0]) == [21]
