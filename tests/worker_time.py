"""Busy seconds per pytest-xdist worker and per group, printed at the end of ``make test``.

The suite's wall time is that of its busiest worker: the one running the session Ray cluster's
group, or the other one with the rest. These lines show which, and by how much, from the one run
a change was measured with (the 30 slowest tests alone do not tell)."""

from __future__ import annotations

from collections import defaultdict

import pytest

SHOWN_GROUPS = 10


class WorkerTime:
    """Sums each test report's setup, call and teardown seconds by the worker that ran it and by
    its xdist group (the ``@group`` suffix ``--dist loadgroup`` gives a test's id)."""

    def __init__(self) -> None:
        self.by_worker: dict[str, float] = defaultdict(float)
        self.by_group: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # set by xdist's controller; absent without -n
        if node is None:
            return
        self.by_worker[node.gateway.id] += report.duration
        name, _, group = report.nodeid.rpartition("@")
        self.by_group[group if name else report.nodeid.split("::")[0]] += report.duration

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.by_worker:
            return
        terminalreporter.write_sep("=", "busy seconds per worker and per group")
        for worker, seconds in sorted(self.by_worker.items()):
            terminalreporter.write_line(f"{seconds:8.1f}s worker {worker}")
        longest = sorted(self.by_group.items(), key=lambda item: -item[1])[:SHOWN_GROUPS]
        for group, seconds in longest:
            terminalreporter.write_line(f"{seconds:8.1f}s group {group}")


def register(config: pytest.Config) -> None:
    """On xdist's controller only (a worker sees its own reports, without the worker's name)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(WorkerTime(), "raylm-worker-time")
