"""A router replica parses, tokenizes and routes requests without the engine: importing the
router in a fresh interpreter loads no JAX (nor the engine's modules), and the lazily exported
names of ``model`` and ``workers`` are the objects their modules define."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = ("jax", "jaxlib", "workers.engine.llm_engine", "workers.runner.model_runner", "workers.core.scheduler", "model.loaders.load")


def _loaded_after(statement: str) -> set[str]:
    """Modules loaded by ``statement`` in a fresh interpreter (this checkout's packages)."""
    return set(json.loads(_run(f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))")))


def _run(code: str):
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@pytest.mark.parametrize("statement", [
    "import router.app",
    # what a router replica does at start-up: its tokenizer and chat template
    "from model import DEFAULT_MODEL, load_model_info; load_model_info(DEFAULT_MODEL).tokenizer.apply_chat_template("
    "[{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)",
])
def test_the_router_loads_no_engine(statement):
    loaded = _loaded_after(statement)
    assert not loaded & set(ENGINE_MODULES), sorted(loaded & set(ENGINE_MODULES))


def test_the_engine_still_loads_through_the_package_names():
    assert {"jax", "workers.engine.llm_engine"} <= _loaded_after("from workers import LLM")


@pytest.mark.parametrize("package", ["model", "workers"])
def test_every_exported_name_is_what_its_module_defines(package):
    """An export named like a submodule comes back as the submodule once that is imported
    (``model.decoder.forward`` would): with every submodule imported first, each name in ``__all__``
    is still the defining module's object."""
    code = (
        f"import importlib, json, pkgutil, types, {package}\n"
        f"for info in pkgutil.iter_modules({package}.__path__):\n"
        f"    importlib.import_module('{package}.' + info.name)\n"
        f"print(json.dumps([n for n in {package}.__all__ if isinstance(getattr({package}, n), types.ModuleType)]))"
    )
    assert json.loads(_run(code)) == []
