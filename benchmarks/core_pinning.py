"""One core per worker replica, for benchmarks that compare deployments "with the same cores".

Ray's ``num_cpus`` is a scheduling slot, not a core: two replicas with ``num_cpus: 1`` on a
2-core machine both run wherever the OS puts their threads, and XLA's CPU client sizes its
intra-op pool (the one the C++ kernels split work over) to every core the process may use.
So a benchmark that means "each replica gets one core" does two things:

- ``NPROC=1`` in the environment the Ray cluster starts with (workers inherit it): XLA's CPU
  client reads it for its intra-op pool size (``DefaultThreadPoolSize``), so each replica
  computes on one thread, as it would on one core;
- after the replicas have started, ``pin_replicas`` sets the CPU affinity of every thread of
  each worker replica process to a core of its own (round robin over the cores this process
  may use). Threads a pinned thread starts later inherit its affinity.

The router, the HTTP proxy, Ray's own processes and the load generator stay unpinned.
"""

from __future__ import annotations

import dataclasses
import os

import psutil

XLA_POOL_ENV = {"NPROC": "1"}


@dataclasses.dataclass(frozen=True)
class PinnedReplica:
    """A worker replica process and the core its threads were pinned to."""

    pid: int
    deployment: str
    core: int
    threads: int
    xla_pool_threads: int  # threads of XLA's intra-op pool ("tf_XLAEigen"): 1 under NPROC=1


def replica_processes(app: str) -> list[tuple[int, str]]:
    """``(pid, deployment)`` of every Serve replica process of ``app`` whose deployment name ends
    in ``Worker`` (``LLMWorker``, ``LLMPrefillWorker``) among this process's descendants (the Ray
    cluster it started), sorted by deployment then pid; found by the process title Ray gives an
    actor (``ray::ServeReplica:APP:DEPLOYMENT...``)."""
    found = []
    marker = f"ServeReplica:{app}:"
    # Only this process's own cluster (its raylet's workers): other Ray clusters on the machine
    # may serve an application of the same name.
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        if marker not in title:
            continue
        deployment = title.split(marker, 1)[1].split()[0].split(".")[0]
        if deployment.endswith("Worker"):
            found.append((process.pid, deployment))
    return sorted(found, key=lambda item: (item[1], item[0]))


def pin_replicas(app: str, expected: int) -> list[PinnedReplica]:
    """Pin each of ``app``'s ``expected`` worker replica processes to a core of its own; raises
    if the processes found are not that many (a replica restarting, or another app's name
    sharing the prefix) or there are fewer cores than replicas."""
    processes = replica_processes(app)
    if len(processes) != expected:
        raise RuntimeError(f"expected {expected} worker replica processes of {app!r}, found {processes}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < expected:
        raise RuntimeError(f"{expected} replicas need as many cores; this process may use {cores}")
    pinned = []
    for (pid, deployment), core in zip(processes, cores):
        threads, pool = 0, 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    pool += "XLAEigen" in comm.read()
                threads += 1
            except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
                pass
        pinned.append(PinnedReplica(pid, deployment, core, threads, pool))
    return pinned
