"""The busy-seconds summary of ``make test`` (tests/worker_time.py), on a small run of its own: two
xdist workers, three groups whose tests sleep known times."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import time
import pytest

@pytest.mark.xdist_group("long")
@pytest.mark.parametrize("i", range(2))
def test_long(i):
    time.sleep(0.6)

@pytest.mark.xdist_group("short")
def test_short():
    time.sleep(0.2)

def test_ungrouped():
    time.sleep(0.1)
'''

CONFTEST = '''
from tests.worker_time import register

def pytest_configure(config):
    register(config)
'''


def _run(tmp_path: Path, *options: str) -> str:
    (tmp_path / "test_sleeps.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path), "-q",
                           "-p", "no:cacheprovider", *options, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _seconds(out: str, what: str) -> dict[str, float]:
    return {name: float(s) for s, name in re.findall(rf"^\s*([\d.]+)s {what} (\S+)$", out, re.MULTILINE)}


def test_each_worker_and_group_is_summed_from_its_tests(tmp_path):
    out = _run(tmp_path, "-n", "2", "--dist", "loadgroup")
    groups, workers = _seconds(out, "group"), _seconds(out, "worker")
    assert 1.2 <= groups["long"] < 2.0, out  # two tests of 0.6 s
    assert 0.2 <= groups["short"] < 0.6, out
    assert 0.1 <= groups["test_sleeps.py"] < 0.5, out  # an ungrouped test counts under its module
    assert set(workers) == {"gw0", "gw1"}, out
    assert abs(sum(workers.values()) - sum(groups.values())) < 0.3, out  # the same reports (printed rounded)
    assert max(workers.values()) >= 1.2, out  # the long group ran on one worker


def test_nothing_is_printed_without_xdist(tmp_path):
    assert "busy seconds" not in _run(tmp_path)
