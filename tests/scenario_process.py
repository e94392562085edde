"""Run a scenario module (one that starts a Ray cluster of its own, isolated from the session's)
in a subprocess and read the one JSON line of findings it prints last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_scenario(module: str, timeout: float) -> dict[str, Any]:
    """``python -m module`` from the repository root; its last JSON line, which must say ``ok``
    (else the assertion shows the scenario's error and the process's output)."""
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result line; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["ok"], f"{result.get('error')}\n{proc.stderr[-4000:]}"
    return result
