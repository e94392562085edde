"""Engine hot path, this tree against a baseline commit, side by side in alternating rounds.

A baseline commit is exported (``git archive``) to a temporary directory and each tree runs
in its own worker process with the bundled model loaded; the parent asks them in turn, so
both see the same machine load (other work on a shared machine shifts both alike). Reports:

1. ``steps``: one jitted one-token step of ``model.decoder.forward`` with the CPU kernels, as the
   engine's decode programs run it without their sampling (pool 512 blocks, block-table
   width 16, context 100 tokens per row) at 1/4/16/64 rows, median ms, and its compile time.
2. ``offline``: ``workers.LLM`` output tokens/s for 1 and 16 sequences (128-token prompts,
   128 output tokens, EOS ignored, prefix caching off, timed after a first run compiled).
3. ``prefill``: ``workers.LLM`` prompt tokens/s for 8 prompts of 512 tokens (one output
   token each, prefix caching off), the prompt side of every serving workload.
4. ``compile``: wall time of the all-buckets warm-up of the deploy defaults (max_num_seqs
   64, 512 batched tokens, 4 scheduler steps, max_model_len 4096), persistent cache off.

    python -m raylm.benchmarks.decode_step_bench --baseline HEAD~1 [--parts steps,offline,prefill,compile]

Workers only use names both trees export (``load_model``, ``KVCache.create``, ``forward``,
``raylm.workers.engine.llm.LLM``): the baseline can be any commit with the ``raylm`` namespace
(``raylm.benchmarks.source_trees``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raylm.benchmarks.source_trees import export_baseline, import_env

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "
NUM_BLOCKS, BLOCK_SIZE, WIDTH, CONTEXT = 512, 16, 16, 100
DEPLOY_DEFAULTS = dict(max_num_seqs=64, max_num_batched_tokens=512, num_scheduler_steps=8, max_model_len=4096,
                       num_kv_blocks=2049)


# -- worker side (runs inside one tree) ---------------------------------------------------------------
class Worker:
    """Holds the model and compiled programs of one tree; answers one JSON command per line."""

    def __init__(self) -> None:
        from raylm.model.config.registry import DEFAULT_MODEL
        from raylm.model.loaders.load import load_model

        self.model = load_model(DEFAULT_MODEL, "float32")
        self.steps: dict[int, Any] = {}
        self.llm = None

    def setup_steps(self, rows: list[int]) -> dict[str, float]:
        """Compile the decode step at each row count; returns compile seconds per row count."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from raylm.model.decoder.forward import forward
        from raylm.model.decoder.kv_pool import KVCache

        c, params = self.model.config, self.model.params
        if hasattr(KVCache, "create"):
            self.kv = KVCache.create(c, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
        else:  # a baseline from before KVCache.create
            self.kv = KVCache.zeros(c.num_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, jnp.float32)
        out = {}
        for r in rows:
            rng = np.random.RandomState(r)
            table = np.arange(1, 1 + r * WIDTH, dtype=np.int32).reshape(r, WIDTH) % (NUM_BLOCKS - 1) + 1
            args = (jnp.asarray(rng.randint(1000, c.vocab_size, r), jnp.int32), jnp.full((r,), CONTEXT - 1, jnp.int32),
                    jnp.asarray(table), jnp.full((r,), CONTEXT, jnp.int32))
            start = time.perf_counter()
            lowered = None  # the kernels where this tree has them, by each tree's flag name
            for flags in ({"cpu_kernels": True}, {"attention_kernel": True}, {}):
                def one_token(params, kv, tokens, positions, table, lens, flags=flags):
                    out = forward(params, c, tokens[:, None], positions[:, None], kv, table, lens, **flags)
                    return out[0], out[1]

                try:
                    lowered = jax.jit(one_token, donate_argnums=1).lower(params, self.kv, *args)
                    break
                except TypeError:
                    continue
            exe = lowered.compile()
            out[str(r)] = time.perf_counter() - start
            self.steps[r] = (exe, args)
            self.step(r, 2)
        return out

    def step(self, rows: int, n: int) -> float:
        """Median seconds of ``n`` decode steps at ``rows`` rows."""
        exe, args = self.steps[rows]
        times = []
        for _ in range(n):
            start = time.perf_counter()
            logits, self.kv = exe(self.model.params, self.kv, *args)
            logits.block_until_ready()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def offline(self, seqs: int, new_tokens: int, prompt_len: int = 128) -> float:
        """Output tokens/s of ``workers.LLM`` for ``seqs`` prompts of ``prompt_len`` tokens."""
        _, outputs, wall = self._generate(seqs, prompt_len, new_tokens)
        return outputs / wall

    def prefill(self, seqs: int, prompt_len: int) -> float:
        """Prompt tokens/s of ``workers.LLM`` (one output token per prompt)."""
        prompts, _, wall = self._generate(seqs, prompt_len, 1)
        return prompts / wall

    def _generate(self, seqs: int, prompt_len: int, new_tokens: int) -> tuple[int, int, float]:
        """Prompt tokens, output tokens and wall seconds of one ``generate`` call."""
        import numpy as np

        from raylm.workers.core.sampling_params import SamplingParams
        from raylm.workers.engine.llm import LLM

        if self.llm is None:
            self.llm = LLM(self.model, enable_prefix_caching=False, max_num_seqs=64, max_model_len=1024,
                           num_kv_blocks=64 * 20 + 1)
        rng = np.random.RandomState(seqs)
        prompts = [{"prompt_token_ids": rng.randint(1000, self.model.config.vocab_size, prompt_len).tolist()}
                   for _ in range(seqs)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - start
        return seqs * prompt_len, sum(len(o.outputs[0].token_ids) for o in outs), wall

    def compile_all(self) -> dict[str, float]:
        """Seconds to build an engine with warm-up of every bucket (no persistent cache)."""
        from raylm.workers.engine.llm import LLM

        start = time.perf_counter()
        llm = LLM(self.model, warmup=True, **DEPLOY_DEFAULTS)
        wall = time.perf_counter() - start
        return {"seconds": wall, "programs": len(llm.engine.runner.warmup_shapes(DEPLOY_DEFAULTS["num_scheduler_steps"]))}


def worker_main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    worker = Worker()
    print(RESULT + json.dumps(str(Path(sys.modules["raylm.model"].__file__).resolve().parent.parent)))
    for line in sys.stdin:
        cmd = json.loads(line)
        result = getattr(worker, cmd.pop("op"))(**cmd)
        print(RESULT + json.dumps(result))


# -- parent side -----------------------------------------------------------------------------------------
class Tree:
    """A worker process running in one source tree."""

    def __init__(self, name: str, root: Path):
        self.name = name
        # This tree's file runs in both (the baseline may predate it); its imports resolve into ``root``.
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            cwd=root, env=import_env(root), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.root = self._read()

    def _read(self) -> Any:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")

    def ask(self, op: str, **kwargs: Any) -> Any:
        self.proc.stdin.write(json.dumps(dict(op=op, **kwargs)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def alternate(trees: list[Tree], rounds: int, op: str, **kwargs: Any) -> dict[str, float]:
    """Median over ``rounds`` rounds, each asking every tree once (order flipped each round)."""
    samples: dict[str, list[float]] = {t.name: [] for t in trees}
    for i in range(rounds):
        for t in trees if i % 2 == 0 else trees[::-1]:
            samples[t.name].append(t.ask(op, **kwargs))
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--parts", default="steps,offline,prefill,compile")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.worker:
        return worker_main()

    parts = set(args.parts.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    trees = [Tree("before", export_baseline(args.baseline)), Tree("after", ROOT)]
    print(f"before = {args.baseline} ({trees[0].root}), after = working tree ({trees[1].root}); "
          f"medians of {args.rounds} alternating rounds")
    try:
        if "steps" in parts:
            compiled = {t.name: t.ask("setup_steps", rows=rows) for t in trees}
            print(f"\ndecode step (pool {NUM_BLOCKS} blocks, width {WIDTH}, context {CONTEXT}), ms")
            print(f"{'rows':>5}{'before':>10}{'after':>10}{'ratio':>8}{'compile before':>16}{'after (s)':>11}")
            for r in rows:
                m = alternate(trees, args.rounds, "step", rows=r, n=5)
                print(f"{r:5d}{m['before'] * 1e3:10.1f}{m['after'] * 1e3:10.1f}{m['before'] / m['after']:7.2f}x"
                      f"{compiled['before'][str(r)]:16.2f}{compiled['after'][str(r)]:11.2f}")
        if "offline" in parts:
            print(f"\nworkers.LLM, 128-token prompts, {args.new_tokens} output tokens, prefix caching off (out tok/s)")
            for seqs in (1, 16):
                for t in trees:  # first run compiles this batch's buckets
                    t.ask("offline", seqs=seqs, new_tokens=8)
                m = alternate(trees, max(3, args.rounds // 2), "offline", seqs=seqs, new_tokens=args.new_tokens)
                print(f"{seqs:3d} sequences: before {m['before']:7.1f}  after {m['after']:7.1f}  "
                      f"ratio {m['after'] / m['before']:.2f}x")
        if "prefill" in parts:
            print("\nworkers.LLM, 8 prompts of 512 tokens, 1 output token, prefix caching off (prompt tok/s)")
            for t in trees:  # first run compiles
                t.ask("prefill", seqs=8, prompt_len=512)
            m = alternate(trees, max(3, args.rounds // 2), "prefill", seqs=8, prompt_len=512)
            print(f"  before {m['before']:7.1f}  after {m['after']:7.1f}  ratio {m['after'] / m['before']:.2f}x")
        if "compile" in parts:
            print(f"\nall-buckets warm-up, {DEPLOY_DEFAULTS}, persistent cache off")
            for t in trees:
                r = t.ask("compile_all")
                print(f"{t.name:>7}: {r['seconds']:6.1f} s for {r['programs']} programs")
    finally:
        for t in trees:
            t.close()


if __name__ == "__main__":
    main()
