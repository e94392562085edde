"""Custom logits processors on the host: a step's rows that carry them are sampled again from
their processed logits (``raylm.workers.core.logits_processors``), after the device sampled
every row as usual."""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from raylm.workers.core.logits_processors import LogitsProcessorError, apply_processors
from raylm.workers.core.step_plan import ScheduledRow
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.runner.programs import resample
from raylm.workers.runner.sampler import SampleResult, SamplingBatch

logger = logging.getLogger(__name__)

Processing = Callable[..., SampleResult]


def processing(seqs: list[ScheduledRow], logits: jax.Array | None, sbatch: SamplingBatch, flags: dict,
               samples: list[bool] | None = None) -> Processing | None:
    """For a call whose rows ``seqs`` include logits processors (``logits`` not None): a
    function taking the fetched samples of one step (``[B]`` rows), the step's output and the
    step's index, and returning the samples with those rows sampled again from their processed
    logits. A row whose processor fails keeps no sample and is recorded in the output's
    ``processor_failures``. ``samples``: which rows sample (a prompt chunk that does not end its
    prompt does not)."""
    if logits is None:
        return None

    def process(fetched: SampleResult, out: RunnerOutput, step: int | None = None) -> SampleResult:
        host = np.array(jax.device_get(logits if step is None else logits[step]))
        rows = []
        for r, seq in enumerate(seqs):
            if seq.params.logits_processors and (samples is None or samples[r]):
                try:
                    host[r] = apply_processors(seq.params.logits_processors, seq.prompt_ids, seq.output_ids, host[r])
                    rows.append(r)
                except LogitsProcessorError as err:
                    logger.error("request %s: %s", seq.request_id, err)
                    out.processor_failures[seq.seq_id] = str(err)
        again = jax.device_get(resample(jnp.asarray(host), sbatch, **flags))
        picked = np.zeros(len(host), bool)
        picked[rows] = True
        return SampleResult(*(np.where(picked.reshape(-1, *[1] * (np.ndim(a) - 1)), b, a)
                              for a, b in zip(fetched, again)))

    return process
