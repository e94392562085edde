"""A router replica parses, tokenizes and routes requests without the engine: importing the
router, the wire types or ``raylm.workers`` in a fresh interpreter loads no JAX (nor the
engine's modules); building an engine does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = (
    "jax", "jaxlib", "raylm.workers.engine.llm_engine", "raylm.workers.runner.model_runner",
    "raylm.workers.core.scheduler", "raylm.model.loaders.load",
)


def _loaded_after(statement: str) -> set[str]:
    """Modules loaded by ``statement`` in a fresh interpreter (this checkout's packages)."""
    return set(json.loads(_run(f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))")))


def _run(code: str):
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@pytest.mark.parametrize("statement", [
    "import raylm.router.app",
    "import raylm.workers.wire.replica_protocol",
    "from raylm.workers import LLM, AsyncEngine, SamplingParams",
    # what a router replica does at start-up: its tokenizer and chat template
    "from raylm.model.config.registry import DEFAULT_MODEL\n"
    "from raylm.model.config.model_info import load_model_info\n"
    "load_model_info(DEFAULT_MODEL).tokenizer.apply_chat_template("
    "[{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)",
])
def test_the_router_loads_no_engine(statement):
    loaded = _loaded_after(statement)
    assert not loaded & set(ENGINE_MODULES), sorted(loaded & set(ENGINE_MODULES))


def test_building_an_engine_loads_it():
    loaded = _loaded_after(
        "from raylm.workers import LLM\n"
        "from raylm.model.config.registry import DEFAULT_MODEL\n"
        "LLM(DEFAULT_MODEL, max_model_len=256, num_kv_blocks=8, warmup=False)"
    )
    assert {"jax", "raylm.workers.engine.llm_engine"} <= loaded
