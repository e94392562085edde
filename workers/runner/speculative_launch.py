"""The runner's speculative decode launch: a decode step through ``spec_decode_program`` when
the replica speculates (``workers/runner/speculative_step.py`` holds the programs and their inputs).

``SpeculativeLaunch`` is a part of ``ModelRunner`` (its base class) kept in its own file: it
uses the runner's pools, buckets, sampling inputs and ``_run``.
"""

from __future__ import annotations

import jax
import numpy as np

from raylm.workers.core.step_plan import ScheduledDecode
from raylm.workers.core.step_result import Collect, RunnerOutput
from raylm.workers.runner.batch_inputs import lora_slots
from raylm.workers.runner.grammar_masks import position_bitmasks
from raylm.workers.runner.sampler import result_row
from raylm.workers.runner.speculative_step import (
    assert_room_for_guesses,
    check_draft_guesses,
    draft_program,
    ngram_proposals,
    spec_decode_program,
    window_inputs,
)


class SpeculativeLaunch:
    """The decode launch of a runner (``ModelRunner``), speculative or plain."""

    def _launch_decode_step(self, decodes: list[ScheduledDecode], num_steps: int) -> Collect:
        """A plain decode, or a speculative one: a draft model's pool must see every token the
        target computes, so with one every decode goes through the speculative program (zero
        guesses when the scheduler allowed none); n-gram rows without a match decode plainly."""
        rows, width = self.buckets.rows(len(decodes)), self.buckets.width([d.row for d in decodes])
        if self.speculative is None:
            return self._launch_decode(decodes, rows, width, num_steps)
        for decode in decodes:
            assert_room_for_guesses(decode, self.block_size)
        num_guesses, proposals = [d.guesses for d in decodes], None
        if self.draft is None:
            proposals = ngram_proposals(decodes, self.speculative)
            if not any(proposals):
                return self._launch_decode(decodes, rows, width, 1)
            num_guesses = [min(k, len(p)) for k, p in zip(num_guesses, proposals)]
        K = self.speculative.num_speculative_tokens if any(num_guesses) else 0
        return self._launch_spec(decodes, rows, width, K, num_guesses, proposals)

    def _launch_spec(self, decodes: list[ScheduledDecode], rows: int, width: int, num_speculative: int,
                     num_guesses: list[int] = (), proposals: list[list[int]] | None = None) -> Collect:
        """A speculative step (``workers/runner/speculative_step.py``): row ``r`` carries ``num_guesses[r]``
        guesses, ``proposals[r]`` from the host, else the draft model's."""
        K = num_speculative
        seqs = [d.row for d in decodes]
        window_tokens, window_positions = window_inputs(decodes, rows, self.draft is not None)
        guesses = np.zeros((rows, K), np.int32)
        num_drafts = np.zeros(rows, np.int32)
        num_drafts[: len(num_guesses)] = num_guesses
        for r, proposal in enumerate(proposals or ()):
            guesses[r, : num_drafts[r]] = proposal[: num_drafts[r]]
        table = self._tables(seqs, rows, width)
        drafted = num_drafts.copy()  # what the draft model computes (its lag depends on it)
        draft_args, draft_config = self._draft_args, self._draft_config
        constrained = K > 0 and any(s.matcher is not None for s in seqs)
        if constrained and self.draft is not None:
            # Structured output rows: the draft proposes alone, the host checks its guesses
            # against the grammars, and the target verifies what they accept.
            proposed, self.draft.kv = draft_program(
                self.draft.params, self.draft.kv, window_tokens, window_positions, num_drafts, table,
                draft_config=self.draft.config, num_speculative=K, cpu_kernels=self.cpu_kernels,
            )
            guesses = np.array(jax.device_get(proposed))
            check_draft_guesses(seqs, guesses, num_drafts)
            draft_args, draft_config = (None, None), None
        bitmasks = position_bitmasks(seqs, rows, self.config.vocab_size, guesses, num_drafts) if constrained else None
        sbatch, flags = self._sampling(seqs, rows, None if bitmasks is None else bitmasks[0])
        # Passed only when there are some: an argument given as None is another signature to
        # jit than one left out, and the warmed-up programs leave it out.
        masks = {} if bitmasks is None else {"position_bitmasks": bitmasks}
        samples, accepted, self.kv, draft_kv, load = self._run(
            spec_decode_program, self.params, self.kv, *draft_args, window_tokens, window_positions, guesses,
            num_drafts, table, sbatch, config=self.config, draft_config=draft_config, num_speculative=K,
            cpu_kernels=self.cpu_kernels, gpu_kernels=self.gpu_kernels, **masks, **flags,
            **self._lora(lora_slots(seqs, rows)), **self._expert_load(),
        )
        self._keep(draft_kv, None, load)  # (no draft pool back when the draft proposed alone)

        def collect(out: RunnerOutput) -> None:
            fetched, accepted_host = jax.device_get((samples, accepted))
            for r, seq in enumerate(seqs):
                a = int(accepted_host[r])
                out.accepted[seq.seq_id] = (int(num_drafts[r]), a)
                # The draft computed the window and its guesses but the last: after a fully
                # accepted run it is one token behind the target.
                out.draft_lags[seq.seq_id] = int(self.draft is not None and 0 < drafted[r] == a)
                out.samples[seq.seq_id] = [result_row(fetched, (j, r)) for j in range(a + 1)]

        return collect
