"""Which LoRA adapters a replica knows, which it keeps in host memory, and which fill its device slots.

A request names its adapter with a ``LoRARequest`` (vLLM's offline handle). ``LoraAdapters``
reads the adapter when it is first asked for (so a bad one is refused when the request
arrives, naming the problem) and keeps the ``max_cpu_loras`` most recently used in host
memory, reading others from disk again when they come back. ``LoraSlots`` is the scheduler's
view of the ``max_loras`` device slots (``model/lora_weights.py``): a sequence takes its
adapter's slot when it is admitted and holds it until it ends or is preempted; an adapter not
resident gets a free slot, else the least recently used slot no running sequence holds, and the
load is handed to the runner with the step that first uses it. When every slot is held by
adapters of running sequences, a request for another adapter waits in the queue while the
others run.
"""

from __future__ import annotations

import collections
import dataclasses

from model.config import ModelConfig
from model.lora import LoraAdapter, load_lora_adapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter to generate with (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``):
    its name (what an HTTP request's ``model`` says; it keys the adapter, and the prefix cache),
    a positive id, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer (0 is the base model), got {self.lora_int_id!r}")


class LoraAdapters:
    """The adapters a replica has been asked for, by name, and the host copies of the most recent."""

    def __init__(self, config: ModelConfig, max_rank: int, max_cpu_loras: int):
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.known: dict[str, LoRARequest] = {}
        self._host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # least recent first

    def add(self, request: LoRARequest) -> LoraAdapter:
        """Know ``request``'s adapter, reading it if it is not in host memory; raises
        ``LoraAdapterError`` (a ValueError) for one that cannot be served, and ValueError for a
        name already taken by another adapter."""
        known = self.known.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"LoRA adapter name {request.lora_name!r} is taken by {known}; "
                             f"give {request} another name")
        adapter = self.get(request)
        self.known[request.lora_name] = request
        return adapter

    def get(self, request: LoRARequest) -> LoraAdapter:
        """The adapter's host copy, read from disk when it is not kept."""
        adapter = self._host.get(request.lora_name)
        if adapter is None:
            adapter = load_lora_adapter(request.lora_name, request.lora_path, self.config, self.max_rank)
            self._host[request.lora_name] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(request.lora_name)
        return adapter


class LoraSlots:
    """The device slots (numbered 1..n; 0 is the base model): which adapter each holds, how many
    running sequences use it, and the loads the next step must make before it runs."""

    def __init__(self, num_slots: int, adapters: LoraAdapters):
        self.adapters = adapters
        self._free = list(range(num_slots, 0, -1))
        self._slot_of: dict[str, int] = {}
        self._users: dict[int, int] = {}  # slot -> sequences holding it
        self._recent: collections.OrderedDict[int, str] = collections.OrderedDict()  # resident, least recent first
        self._loads: list[tuple[int, LoraAdapter]] = []
        self.num_loads = 0
        self.num_evictions = 0

    def acquire(self, request: LoRARequest) -> int | None:
        """A slot holding ``request``'s adapter for one more sequence (loading it if needed); None
        when every slot is held by another adapter a running sequence uses."""
        slot = self._slot_of.get(request.lora_name)
        if slot is None:
            slot = self._free.pop() if self._free else self._evictable()
            if slot is None:
                return None
            evicted = self._recent.pop(slot, None)
            if evicted is not None:
                del self._slot_of[evicted]
                self.num_evictions += 1
            self._slot_of[request.lora_name] = slot
            self._loads.append((slot, self.adapters.get(request)))
            self.num_loads += 1
        self._users[slot] = self._users.get(slot, 0) + 1
        self._recent[slot] = request.lora_name
        self._recent.move_to_end(slot)
        return slot

    def _evictable(self) -> int | None:
        return next((slot for slot in self._recent if not self._users.get(slot)), None)

    def release(self, slot: int) -> None:
        """A sequence no longer uses ``slot`` (its adapter stays resident until evicted)."""
        self._users[slot] -= 1
        if not self._users[slot]:
            del self._users[slot]

    def take_loads(self) -> list[tuple[int, LoraAdapter]]:
        """The (slot, adapter) loads acquired since the last call, for the runner."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def resident(self) -> dict[str, int]:
        """Adapter name -> its slot, for every adapter on the device."""
        return dict(self._slot_of)

    @property
    def num_in_use(self) -> int:
        """Slots some running sequence holds."""
        return len(self._users)
