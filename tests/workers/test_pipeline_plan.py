"""What a pipeline stage is given, without a model: its layers (``split_layers``), the step plan as a
stage reads it (``stage_plan``: nothing only sampling reads, LoRA adapters cut to its layers), and a
checkpoint's layers read by slice (``ModelConfig.layer_slice``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raylm.model.loaders.lora_adapter import LoraAdapter
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, ScheduledRow, SchedulerOutput
from raylm.workers.pipeline.stage_runners import split_layers, stage_plan


@pytest.mark.parametrize("layers, stages, expected", [
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),  # the first stages take the one more
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (5, 1, [(0, 5)]),
])
def test_layers_split_contiguously_and_evenly(layers, stages, expected):
    spans = split_layers(layers, stages)
    assert [(s.start, s.stop) for s in spans] == expected
    assert [s.index for s in spans] == list(range(stages)) and spans[0].is_first and spans[-1].is_last


@pytest.mark.parametrize("stages", [0, 4])
def test_more_stages_than_layers_are_refused(stages):
    with pytest.raises(ValueError, match="between 1 and the model's 3 layers"):
        split_layers(3, stages)


def test_a_stage_plan_keeps_what_its_layers_compute_and_cuts_adapters_to_them():
    row = ScheduledRow(7, "r", (1, 2), SamplingParams(temperature=0.5, logprobs=2), 3, [5, 6, 7], [8],
                       matcher=object(), lora_slot=1)
    weights = {(layer, "qkv"): (np.full((1, 1), layer), np.zeros((1, 1))) for layer in range(6)}
    adapter = LoraAdapter("a", "/a", 1, 1.0, weights)
    plan = SchedulerOutput([ScheduledChunk(row, 0, (5, 6), False)], [ScheduledDecode(row, 2, (8,))], 1, [(1, 3)],
                           lora_loads=[(1, adapter), (2, None)], kv_writes=[(4, b"")])
    second = split_layers(6, 2)[1]
    cut = stage_plan(plan, second)
    stripped = cut.prefills[0].row
    assert cut.decodes[0].row is stripped  # one row per sequence
    assert (stripped.seq_id, stripped.block_ids, stripped.lora_slot) == (7, (1, 2), 1)
    assert (stripped.matcher, tuple(stripped.prompt_ids), tuple(stripped.output_ids)) == (None, (), ())
    assert stripped.params == SamplingParams()
    assert cut.prefills[0].token_ids == (5, 6) and cut.decodes[0].window == (8,) and cut.block_copies == [(1, 3)]
    (slot, stage_adapter), empty = cut.lora_loads
    assert slot == 1 and empty == (2, None) and not cut.kv_writes
    # Layers 3-5 of the adapter, numbered from 0 as the stage's own.
    assert {layer: int(a[0, 0]) for (layer, _), (a, _) in stage_adapter.weights.items()} == {0: 3, 1: 4, 2: 5}
    assert dataclasses.replace(stage_adapter, weights=adapter.weights) == adapter
