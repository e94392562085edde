"""The pipeline benchmark's engine in a Ray actor on one node (``pipeline_bench.py``), and what it
measures there: timed greedy batches with each stage's busy seconds over the batch, the bytes each
stage holds, the processes to pin, and the resident memory of a process.

The offline ``LLM`` runs in the actor (not Serve): with ``pipeline_parallel_size: 2`` the actor
is the last stage and starts the first as an actor of its own, which takes bundle 1 of the
placement group the host was placed in (``workers/pipeline/ray_stages.py``, as in a Serve replica).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import psutil

from raylm.model.quantization.quant_array import weight_bytes
from raylm.workers.pipeline.pipeline_runner import PipelineRunner


class EngineHost:
    """An ``LLM`` over ``model`` with ``engine`` arguments, in this actor's process."""

    def __init__(self, model: str, dtype: str, engine: dict[str, Any]):
        from raylm.workers.engine.llm import LLM

        self.llm = LLM(model, dtype=dtype, **engine)

    def processes(self) -> dict[str, Any]:
        """This process and the stage actors' (pid, node id), in stage order, the last stage this one."""
        import ray

        own = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        runner = self.llm.engine.runner
        if not isinstance(runner, PipelineRunner):
            return {"stages": [own]}
        others = [stage.describe() for stage in runner.stages]
        return {"stages": [{"pid": d["pid"], "node_id": d["node_id"]} for d in others] + [own]}

    def held_bytes(self) -> list[dict[str, int]]:
        """Weight and KV pool bytes of each stage, in stage order (one entry without stages)."""
        runner = self.llm.engine.runner
        if not isinstance(runner, PipelineRunner):
            return [{"weight_bytes": weight_bytes(runner.params), "kv_bytes": _tree_bytes(runner.kv)}]
        others = [stage.describe() for stage in runner.stages]
        last = runner.last
        return [{"weight_bytes": d["weight_bytes"], "kv_bytes": d["kv_bytes"]} for d in others] + [
            {"weight_bytes": weight_bytes(last.params), "kv_bytes": _tree_bytes(last.kv)}]

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Complete ``prompts`` at once, greedy, ``max_tokens`` each: wall seconds, output tokens,
        each stage's busy seconds in that window (none without stages) and the tokens."""
        from raylm.workers.core.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        runner = self.llm.engine.runner
        pipelined = isinstance(runner, PipelineRunner)
        busy_before = runner.stage_busy_seconds() if pipelined else []
        started = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - started
        busy_after = runner.stage_busy_seconds() if pipelined else []
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens), "tokens": tokens,
                "busy_s": [after - before for before, after in zip(busy_before, busy_after)]}

    def close(self) -> None:
        self.llm.engine.close()


def resident_bytes(pid: int) -> int:
    """The process's resident set size."""
    return psutil.Process(pid).memory_info().rss


def pin_process(pid: int, cores: set[int]) -> tuple[int, int]:
    """Set the CPU affinity of every thread of ``pid`` to ``cores`` (threads started later
    inherit it from the thread that starts them); returns how many threads were pinned and how
    many of them are XLA's intra-op pool ("tf_XLAEigen": ``NPROC`` of them)."""
    pinned, pool = 0, 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                pool += "XLAEigen" in comm.read()
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass
    return pinned, pool


def _tree_bytes(tree: Any) -> int:
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(tree))
