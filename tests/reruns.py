"""Tests run again in a fresh pytest process with other settings: for what a process reads once
(a kernel family chosen when its library loads, XLA's forced host device count)."""

from __future__ import annotations

import os
import subprocess
import sys


def rerun_in_child(test_file: str, selection: str, env: dict[str, str], expected: str = " passed") -> None:
    """Run the tests of ``test_file`` that the ``-k`` expression ``selection`` picks, with
    ``env`` added to this environment; all must pass, and the summary must say ``expected``."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert expected in run.stdout and "failed" not in run.stdout
