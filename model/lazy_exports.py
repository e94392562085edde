"""A package's public names, imported on first use (PEP 562 module ``__getattr__``).

``model`` and ``workers`` export names whose modules import JAX; the router needs a few of
their JAX-free modules (tokenizer, wire types) and must not pay for the engine to get them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping, Sequence


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, which exports the names
    ``modules`` lists under each module (relative to the package) defining them. A name is
    imported when first read, then kept in the package.

    An export must not share its name with a submodule: importing the submodule binds its name
    in the package first, and the export would never be looked up."""
    source = {name: f"{package}.{module}" for module, names in modules.items() for name in names}

    def getattr_(name: str) -> Any:
        if name not in source:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(source))

    return sorted(source), getattr_, dir_
