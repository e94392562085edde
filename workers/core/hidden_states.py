"""Hidden-state extraction: a request gets the residual stream of chosen layers for its tokens.

``SamplingParams(return_hidden_states=[...])`` names layers as HF's ``output_hidden_states``
numbers them (0: the embeddings, ``i``: the residual stream after decoder layer ``i - 1``,
``L``: the final-normed output). Entry ``j`` of the result is position ``start + j``'s hidden
states, the ones the next token was sampled from: without the prompt ``start`` is the last
prompt token, so entry ``j`` is what generated token ``j`` came from (as HF's ``generate``
returns them); with ``hidden_states_include_prompt`` ``start`` is 0. The last sampled token
is never fed back, so it has none.

The replica holds fixed device buffers, ``[slots, L + 1, max_tokens, D]`` float32
(``EngineArgs.hidden_state_slots`` / ``hidden_state_max_tokens``). The prefill and decode
programs write every layer of a slot's tokens there as they compute them (inside the jitted
multi-step decode too: no per-token host round trip); the requested layers are transferred
once, when the request finishes. A request holds a slot from its admission to its end (so a
preempted one recomputes into the same slot) and waits in the queue while none is free; one
whose tokens could not fit a slot is refused when it arrives.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence as SequenceOf


@dataclasses.dataclass
class HiddenStateCapture:
    """One sequence's hidden-state request (its result goes to ``RequestState.hidden_states``)."""

    layers: tuple[int, ...]
    start: int  # the first position captured
    slot: int | None = None  # the buffers' slot, from admission on

    @property
    def includes_prompt(self) -> bool:
        return self.start == 0

    def count(self, num_tokens: int) -> int:
        """Positions captured for a sequence of ``num_tokens`` tokens (its last one has none)."""
        return max(0, num_tokens - 1 - self.start)


def check_capture(layers: SequenceOf[int], num_layers: int, prompt_len: int, max_tokens: int, include_prompt: bool,
                  slots: int, capacity: int) -> HiddenStateCapture:
    """The capture a request asks for; ValueError naming the problem when it cannot be served."""
    if slots == 0:
        raise ValueError("hidden states are not enabled on this replica: set engine.hidden_state_slots > 0")
    if not layers or len(set(layers)) != len(layers) or any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"return_hidden_states must be distinct layer indices in [0, {num_layers}] "
                         f"(0: embeddings, {num_layers}: final-normed output), got {list(layers)}")
    start = 0 if include_prompt else prompt_len - 1
    needed = prompt_len - 1 + max_tokens - start
    if needed > capacity:
        raise ValueError(f"hidden states for {needed} positions do not fit the replica's buffers of {capacity} "
                         "(engine.hidden_state_max_tokens); ask for fewer tokens"
                         + (" or leave out the prompt" if include_prompt else ""))
    return HiddenStateCapture(tuple(layers), start)


class HiddenStateSlots:
    """The device buffers' slots: which are free, and which capture owns each taken one. A
    capture keeps its ``slot`` number after release, so its finished buffers can be read
    before the next step writes them."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))
        self._owners: dict[int, HiddenStateCapture] = {}

    def _holds(self, capture: HiddenStateCapture) -> bool:
        return capture.slot is not None and self._owners.get(capture.slot) is capture

    def acquire(self, capture: HiddenStateCapture) -> bool:
        """Give ``capture`` a slot (it keeps the one it holds); False when none is free."""
        if self._holds(capture):
            return True
        if not self._free:
            return False
        capture.slot = self._free.pop()
        self._owners[capture.slot] = capture
        return True

    def release(self, capture: HiddenStateCapture) -> None:
        if self._holds(capture):
            del self._owners[capture.slot]
            self._free.append(capture.slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
