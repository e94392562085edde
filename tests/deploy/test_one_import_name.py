"""Installed, raylm is one import name: a user's own ``model.py``, ``cache.py``, ``workers.py``,
``router.py``, ``deploy.py`` or ``cluster.py`` never shadows raylm's packages, and the
distribution adds no top-level name but ``raylm``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERIC_NAMES = ("model", "cache", "workers", "router", "deploy", "cluster")
RAYLM = Path(sys.executable).with_name("raylm")


def shadowing_folder(path: Path) -> Path:
    """A user's folder holding a module of each generic name, each raising when imported."""
    for name in GENERIC_NAMES:
        (path / f"{name}.py").write_text(f"raise ImportError(\"the user's own {name}.py was imported\")\n")
    return path


def test_raylm_generate_runs_beside_the_users_modules(tmp_path):
    folder = shadowing_folder(tmp_path)
    done = subprocess.run(
        [str(RAYLM), "generate", "--model", "smollm2-135m-instruct", "--prompt", "The capital of France is",
         "--max-tokens", "4", "--temperature", "0"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_a_script_using_raylm_workers_runs_beside_the_users_modules(tmp_path):
    folder = shadowing_folder(tmp_path)
    (folder / "script.py").write_text(
        "from raylm.workers import LLM, SamplingParams\n"
        "llm = LLM('smollm2-135m-instruct', max_model_len=256)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=4, temperature=0))\n"
        "print(out[0].outputs[0].text)\n"
    )
    done = subprocess.run([sys.executable, "script.py"], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_the_built_wheel_adds_only_the_raylm_name(tmp_path):
    """A wheel built from this tree (without the C++ kernels, which take minutes to compile):
    its top-level names are ``raylm`` and its metadata, each package from the folder its name
    says (raylm.model.kernels holds model/kernels's sources)."""
    source = tmp_path / "source"  # a copy: an in-tree build would leave build/ in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", ".jax_cache", ".pytest_cache", ".hypothesis"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        env={**os.environ, "RAYLM_BUILD_KERNELS": "0"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = tmp_path.glob("raylm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"raylm", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "raylm/model/kernels/paged_decode.py" in names and "raylm/workers/core/scheduler.py" in names
    assert "raylm/deploy/default.yaml" in names and "raylm/benchmarks/http_bench.py" in names
