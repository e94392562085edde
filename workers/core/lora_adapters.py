"""Which LoRA adapters a replica knows, which it keeps in host memory, and which fill its device slots.

A request names its adapter with a ``LoRARequest`` (vLLM's offline handle). ``LoraAdapters``
reads the adapter when it is first asked for (so a bad one is refused when the request
arrives, naming the problem) and keeps the ``max_cpu_loras`` most recently used in host
memory, reading others from disk again when they come back. ``LoraSlots`` is the scheduler's
view of the ``max_loras`` device slots (``model/decoder/lora_slots.py``): a sequence takes its
adapter's slot when it is admitted and holds it until it ends or is preempted; an adapter not
resident gets a free slot, else the least recently used slot no running sequence holds, and the
load is handed to the runner with the step that first uses it. When every slot is held by
adapters of running sequences, a request for another adapter waits in the queue while the
others run.
"""

from __future__ import annotations

import collections
import dataclasses

from raylm.model.config.model_config import ModelConfig
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.lora_adapter import LoraAdapter, load_lora_adapter


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter to generate with (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``):
    its name (what an HTTP request's ``model`` says), a positive id that identifies it (as in
    vLLM: one id, one adapter; an adapter loaded again over HTTP gets a new id), and its PEFT
    directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer (0 is the base model), got {self.lora_int_id!r}")

    @property
    def cache_key(self) -> str:
        """What keeps its KV apart in the prefix cache (and in prefix-aware routing): its id,
        so an adapter unloaded and loaded again under the same name never reuses the old KV."""
        return f"{self.lora_int_id}:{self.lora_name}"


class LoraAdapters:
    """The adapters a replica has been asked for, by id, and the host copies of the most recent."""

    def __init__(self, config: ModelConfig, max_rank: int, max_cpu_loras: int):
        if config.mla is not None:  # (its projections are not the q/k/v/o LoRA targets)
            raise UnsupportedModelError(
                f"LoRA adapters are not implemented for {config.architecture}'s latent attention; "
                "start the engine without enable_lora"
            )
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.known: dict[int, LoRARequest] = {}
        self._host: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()  # least recent first

    def add(self, request: LoRARequest) -> LoraAdapter:
        """Know ``request``'s adapter, reading it if it is not in host memory; raises
        ``LoraAdapterError`` (a ValueError) for one that cannot be served, and ValueError for an
        id already taken by another adapter."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is taken by {known}; give {request} another id")
        adapter = self.get(request)
        self.known[request.lora_int_id] = request
        return adapter

    def get(self, request: LoRARequest) -> LoraAdapter:
        """The adapter's host copy, read from disk when it is not kept."""
        key = request.lora_int_id
        adapter = self._host.get(key)
        if adapter is None:
            adapter = load_lora_adapter(request.lora_name, request.lora_path, self.config, self.max_rank)
            self._host[key] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(key)
        return adapter


class LoraSlots:
    """The device slots (numbered 1..n; 0 is the base model): which adapter each holds, how many
    running sequences use it, and the loads the next step must make before it runs. Loads and
    evictions are counted per adapter name (the per-adapter metrics)."""

    def __init__(self, num_slots: int, adapters: LoraAdapters):
        self.adapters = adapters
        self._free = list(range(num_slots, 0, -1))
        # resident adapters by id -> (name, slot), least recently used first
        self._resident: collections.OrderedDict[int, tuple[str, int]] = collections.OrderedDict()
        self._users: dict[int, int] = {}  # slot -> sequences holding it
        self._loads: list[tuple[int, LoraAdapter]] = []
        self.loads: collections.Counter[str] = collections.Counter()
        self.evictions: collections.Counter[str] = collections.Counter()

    def acquire(self, request: LoRARequest) -> int | None:
        """A slot holding ``request``'s adapter for one more sequence (loading it if needed); None
        when every slot is held by another adapter a running sequence uses."""
        key = request.lora_int_id
        if key in self._resident:
            slot = self._resident[key][1]
            self._resident.move_to_end(key)
        else:
            slot = self._free.pop() if self._free else self._evict()
            if slot is None:
                return None
            self._resident[key] = (request.lora_name, slot)
            self._loads.append((slot, self.adapters.get(request)))
            self.loads[request.lora_name] += 1
        self._users[slot] = self._users.get(slot, 0) + 1
        return slot

    def _evict(self) -> int | None:
        """The least recently used slot no running sequence holds, emptied; None if none."""
        key = next((k for k, (_, slot) in self._resident.items() if not self._users.get(slot)), None)
        if key is None:
            return None
        name, slot = self._resident.pop(key)
        self.evictions[name] += 1
        return slot

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
    def resident(self) -> list[str]:
        """The names of the adapters on the device, by slot."""
        return [name for name, _ in sorted(self._resident.values(), key=lambda entry: entry[1])]

    @property
    def num_in_use(self) -> int:
        """Slots some running sequence holds."""
        return len(self._users)
