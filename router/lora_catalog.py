"""The models a router serves: the base model, the deploy file's LoRA adapters, and adapters
loaded and unloaded at run time with vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

The router resolves a request's ``model`` to a ``LoRARequest`` and sends it with the request,
so worker replicas need no registry of their own: each reads an adapter on first use, and one
started later by autoscaling or replacement serves every adapter too. Loaded adapters are
recorded in ``cluster.adapter_store`` for the other router replicas (each refreshes its view
with the replicas' stats, and looks a name it does not know up there at once).

A load is checked in full before anything is recorded (the same checks a replica makes:
``model.loaders.lora_adapter.load_lora_adapter``), so a bad adapter gets a 400 naming the problem and nothing
half-loaded anywhere. Each load gets a fresh ``lora_int_id``: an adapter unloaded and loaded
again under its name is a new adapter to the replicas (its own slot, its own prefix-cache
keys). Unloading behaves like vLLM's: new requests for the name get 404 at once, while
requests already admitted keep their adapter and finish normally; the replicas drop it from
their slots and host memory as other adapters need the room (LRU).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, Mapping

from raylm.cluster.adapter_store import AdapterStore
from raylm.model.config.model_config import ModelConfig
from raylm.model.config.model_info import load_model_info
from raylm.model.errors import LoraAdapterError
from raylm.model.loaders.lora_adapter import load_lora_adapter
from raylm.router.errors import OpenAIError, invalid
from raylm.router.settings import RouterSettings
from raylm.workers.core.lora_adapters import LoRARequest

LOAD_FIELDS = {"lora_name", "lora_path"}
FIRST_DYNAMIC_ID = 1 << 31  # the deploy file's adapters take ids 1, 2, ...


class ModelCatalog:
    """Served model names -> their adapter (None: the base model), and their ``/v1/models`` cards."""

    def __init__(self, settings: RouterSettings, store: AdapterStore, model_config: ModelConfig | None = None):
        self.settings = settings
        self.store = store
        self._model_config = model_config
        self.created = int(time.time())
        self.static = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(settings.lora_modules.items(), 1)}
        # Live: the request parser checks names against this dict's keys.
        self.models: dict[str, LoRARequest | None] = {settings.served_model_name: None, **self.static}
        self.cards: dict[str, dict[str, Any]] = {}
        self._rebuild_cards()

    def adapter(self, model: str) -> LoRARequest | None:
        return self.models.get(model)

    async def find(self, model: Any) -> None:
        """Learn ``model`` from the store when it is a name this router does not know yet (loaded
        through another router replica since the last refresh)."""
        if isinstance(model, str) and model not in self.models:
            entry = await asyncio.to_thread(self.store.get, model)
            if entry is not None:
                self._set({**self._dynamic(), model: _request(model, entry)})

    async def refresh(self) -> None:
        """Follow the store: adapters loaded or unloaded through other router replicas."""
        entries = await asyncio.to_thread(self.store.entries)
        self._set({name: _request(name, entry) for name, entry in entries.items() if name not in self.static})

    async def load(self, body: Any) -> str:
        """Check and record an adapter; vLLM's success text, else an OpenAIError (400)."""
        name, path = _fields(body, LOAD_FIELDS)
        if not self.settings.enable_lora:
            raise invalid("this deployment serves no LoRA adapters: set engine.enable_lora (or model.lora_modules)")
        await self.find(name)
        if name in self.models:
            raise invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        config = await self._config()
        try:
            await asyncio.to_thread(load_lora_adapter, name, path, config, self.settings.max_lora_rank)
        except LoraAdapterError as err:
            raise invalid(str(err), "lora_path") from None
        request = LoRARequest(name, FIRST_DYNAMIC_ID + secrets.randbelow(1 << 62), path)
        if not await asyncio.to_thread(self.store.add, name, {"path": path, "id": request.lora_int_id}):
            raise invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._set({**self._dynamic(), name: request})
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: Any) -> str:
        """Forget an adapter loaded over HTTP; vLLM's success text, else an OpenAIError (404 for
        a name not loaded, 400 for the base model or a deploy-file adapter)."""
        (name,) = _fields(body, {"lora_name"})
        if name == self.settings.served_model_name or name in self.static:
            raise invalid(f"'{name}' is served from the deploy file (model.lora_modules or the base model); "
                          "change it there", "lora_name")
        if not await asyncio.to_thread(self.store.remove, name) and name not in self.models:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="model_not_found")
        self._set({n: r for n, r in self._dynamic().items() if n != name})
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _dynamic(self) -> dict[str, LoRARequest]:
        return {name: r for name, r in self.models.items() if r is not None and name not in self.static}

    def _set(self, dynamic: Mapping[str, LoRARequest]) -> None:
        """Replace the loaded adapters (keeping the order they were learnt in)."""
        known = self._dynamic()
        if dict(dynamic) == known:
            return
        for name in [n for n in self.models if n in known and n not in dynamic]:
            del self.models[name]
        self.models.update(dynamic)
        self._rebuild_cards()

    def _rebuild_cards(self) -> None:
        """vLLM's cards: ``parent`` is the base model, ``root`` the adapter's directory."""
        settings = self.settings
        base = {"id": settings.served_model_name, "object": "model", "created": self.created, "owned_by": "raylm",
                "root": settings.model, "parent": None, "max_model_len": settings.max_model_len}
        self.cards = {name: base if lora is None else {**base, "id": name, "root": lora.lora_path,
                                                      "parent": settings.served_model_name}
                      for name, lora in self.models.items()}

    async def _config(self) -> ModelConfig:
        if self._model_config is None:
            self._model_config = (await asyncio.to_thread(load_model_info, self.settings.model)).config
        return self._model_config


def _request(name: str, entry: Mapping[str, Any]) -> LoRARequest:
    return LoRARequest(name, int(entry["id"]), str(entry["path"]))


def _fields(body: Any, fields: set[str]) -> list[str]:
    """The body's string fields ``fields`` (sorted by name), all required and non-empty."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(f"unknown field(s) {unknown}; expected {sorted(fields)}", unknown[0])
    values = [body.get(field) for field in sorted(fields)]
    if not all(isinstance(v, str) and v for v in values):
        raise invalid(f"{' and '.join(repr(f) for f in sorted(fields))} must be provided as non-empty strings",
                      sorted(fields)[0])
    return values
