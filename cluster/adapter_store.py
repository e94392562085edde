"""Where the LoRA adapters loaded over HTTP (``/v1/load_lora_adapter``) are recorded.

Any router replica may answer a load, and every router replica, including one started later,
must then serve the adapter, so the record lives outside the replicas: in Ray's cluster
key-value store (the GCS), under the application's name and its base model. It outlives
replica restarts and redeploys of the application: an adapter stays until it is unloaded (or
the Ray cluster stops). Worker replicas never read it: a request carries its adapter.

Values are small JSON objects; ``add`` refuses a name that is already there, atomically, so
two routers loading the same name at once cannot both succeed.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

NAMESPACE = "raylm"


class AdapterStore(Protocol):
    """A record of adapters by name; every call may block (run it off the event loop)."""

    def add(self, name: str, entry: dict[str, Any]) -> bool:
        """Record ``name``; False (and nothing changed) when it is recorded already."""

    def remove(self, name: str) -> bool:
        """Forget ``name``; False when it was not recorded."""

    def get(self, name: str) -> dict[str, Any] | None: ...

    def entries(self) -> dict[str, dict[str, Any]]: ...


class MemoryAdapterStore:
    """The record of a router that is alone (in-process, without Ray)."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def add(self, name: str, entry: dict[str, Any]) -> bool:
        return self._entries.setdefault(name, entry) is entry

    def remove(self, name: str) -> bool:
        return self._entries.pop(name, None) is not None

    def get(self, name: str) -> dict[str, Any] | None:
        return self._entries.get(name)

    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self._entries)


class RayAdapterStore:
    """The record in Ray's internal key-value store, one key per adapter under
    ``lora/<app>/<base model>/`` (names may hold any character: keys end in their JSON)."""

    def __init__(self, app_name: str, model: str):
        self.prefix = f"lora/{json.dumps([app_name, model])}/"

    def add(self, name: str, entry: dict[str, Any]) -> bool:
        from ray.experimental.internal_kv import _internal_kv_put

        existed = _internal_kv_put(self._key(name), json.dumps(entry), overwrite=False, namespace=NAMESPACE)
        return not existed

    def remove(self, name: str) -> bool:
        from ray.experimental.internal_kv import _internal_kv_del

        return _internal_kv_del(self._key(name), namespace=NAMESPACE) > 0

    def get(self, name: str) -> dict[str, Any] | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(self._key(name), namespace=NAMESPACE)
        return None if value is None else json.loads(value)

    def entries(self) -> dict[str, dict[str, Any]]:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        out = {}
        for key in _internal_kv_list(self.prefix, namespace=NAMESPACE):
            value = _internal_kv_get(key, namespace=NAMESPACE)
            if value is not None:  # removed since the listing
                out[json.loads(key.decode()[len(self.prefix):])] = json.loads(value)
        return out

    def _key(self, name: str) -> str:
        return self.prefix + json.dumps(name)
