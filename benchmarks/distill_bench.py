"""Candidate (c) of the bundled model's draft: a few layers distilled from the target on its
own outputs with optax, then measured in the engine against plain decoding and the same
layers cut untrained. One process, one run:

1. Data: the served target (GGUF blocks) answers ``--prompts`` chat prompts (topics x
   instructions, none from the benchmark's reference prompts), sampled at temperature 0.7.
2. Labels: the float32 target's top-32 next-token distribution at every position.
3. Training: the draft is the target's first ``--layers`` layers and final norm, trained for
   ``--minutes`` on the labels (cross-entropy against the top-32 distribution; AdamW, cosine
   schedule). The embedding / tied LM head stays the target's, frozen, so in the engine the
   draft shares the served target's arrays and its step costs only its layers plus the head.
   Printed along the way: next-token agreement with the target's argmax on held-out answers.
4. Engine: output tok/s of greedy decoding (chat reference prompts, ``--new-tokens``, EOS
   ignored) with no speculation, with the distilled draft and with the untrained cut, at one
   stream and 4 sequences; acceptance rate; outputs checked identical to plain decoding.

Per-position agreement a gives an acceptance rate of about (a + a^2 + a^3) / 3 at k = 3; the
``--parts cost`` table of ``speculative_bench`` gives the step costs that set the break-even.

    python -m raylm.benchmarks.distill_bench [--layers 2] [--minutes 12] [--k 3]

Needs optax (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raylm.benchmarks.speculative_bench import run_proposer
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.decoder.forward import forward
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.loaders.load import LoadedModel, keep_gguf_blocks, load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

TOPICS = ("volcanoes", "the stock market", "sourdough bread", "black holes", "the Roman empire", "jazz music",
          "machine learning", "climate change", "the human heart", "bicycles", "chess", "coffee", "the moon",
          "electric cars", "honey bees", "the internet", "vaccines", "origami", "glaciers", "recursion",
          "sorting algorithms", "the French revolution", "gardening", "sleep", "marathons", "tea ceremonies",
          "earthquakes", "democracy", "penguins", "the printing press", "quantum computers", "a rainy day",
          "friendship", "learning a language", "budgeting", "video games", "deserts", "the ocean",
          "solar panels", "dinosaurs", "mountains", "public speaking", "Python lists", "SQL joins",
          "prime numbers", "fractions", "the water cycle", "airplanes", "cats", "rivers")
INSTRUCTIONS = ("Explain {} in simple terms.", "Write a short poem about {}.", "List three facts about {}.",
                "What are the pros and cons of {}?", "Tell me a short story involving {}.",
                "How would you teach a child about {}?", "Give me a fun fact about {}.",
                "Summarize the history of {} in a paragraph.")
WINDOW = 256  # training sequence length (prompt + answer, cut)
TOP_K = 32  # teacher probabilities kept per position
HELD_OUT = 32  # answers kept out of training, for the agreement figure
BATCH = 4


def _all_logits(params, config, tokens: jax.Array) -> jax.Array:
    """``forward`` over whole sequences in a fresh pool (the engine's own numerics)."""
    rows, length = tokens.shape
    blocks = length // 16
    kv = KVCache.create(config, rows * blocks + 1, 16, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    tables = jnp.arange(1, rows * blocks + 1, dtype=jnp.int32).reshape(rows, blocks)
    lens = jnp.full((rows,), length, jnp.int32)
    return forward(params, config, tokens, positions, kv, tables, lens, all_logits=True)[0]


def make_data(served: LoadedModel, num_prompts: int, new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token windows ``[N, WINDOW]``, a mask of positions with a next token, and where each answer starts."""
    prompts = [i.format(t) for t in TOPICS for i in INSTRUCTIONS]
    random.Random(0).shuffle(prompts)
    tok = served.tokenizer
    batch = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}], True)}
             for p in prompts[:num_prompts]]
    llm = LLM(served, max_num_seqs=64, enable_prefix_caching=False)
    start = time.perf_counter()
    outputs = llm.generate(batch, SamplingParams(max_tokens=new_tokens, temperature=0.7, seed=1))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"data: {generated} answer tokens from {len(outputs)} prompts in {time.perf_counter() - start:.0f} s")
    tokens = np.zeros((len(outputs), WINDOW), np.int32)
    mask = np.zeros((len(outputs), WINDOW), np.float32)
    for i, o in enumerate(outputs):
        seq = (list(o.prompt_token_ids) + list(o.outputs[0].token_ids))[:WINDOW]
        tokens[i, : len(seq)] = seq
        mask[i, : len(seq) - 1] = 1
    return tokens, mask, np.array([len(o.prompt_token_ids) for o in outputs])


def teacher_labels(teacher: LoadedModel, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-K probabilities and ids, and the argmax, of the teacher at every position."""

    @jax.jit
    def label(chunk):
        logits = _all_logits(teacher.params, teacher.config, chunk)
        values, ids = jax.lax.top_k(logits, TOP_K)
        return jax.nn.softmax(values, axis=-1), ids, jnp.argmax(logits, -1)

    start = time.perf_counter()
    parts = [label(tokens[i : i + 8]) for i in range(0, len(tokens), 8)]
    print(f"labels: {time.perf_counter() - start:.0f} s")
    return tuple(np.concatenate([np.asarray(p[j]) for p in parts]) for j in range(3))


def distill(teacher: LoadedModel, layers: int, minutes: float, tokens: np.ndarray, mask: np.ndarray,
            answer_starts: np.ndarray, labels: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict:
    """The trained layers and final norm; prints agreement on held-out answers as it goes."""
    probs, ids, argmax = labels
    config = teacher.config.first_layers(layers)

    def params(trained):
        return dataclasses.replace(teacher.params, layers=trained["layers"], final_norm=trained["final_norm"])

    def loss(trained, chunk, p, i, m):
        logp = jax.nn.log_softmax(_all_logits(params(trained), config, chunk), -1)
        return jnp.sum(-jnp.sum(p * jnp.take_along_axis(logp, i, -1), -1) * m) / jnp.sum(m)

    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 30, 4000, 1e-4), weight_decay=0.0)

    @jax.jit
    def step(trained, state, chunk, p, i, m):
        value, grads = jax.value_and_grad(loss)(trained, chunk, p, i, m)
        updates, state = optimizer.update(grads, state, trained)
        return optax.apply_updates(trained, updates), state, value

    predict = jax.jit(lambda trained, chunk: jnp.argmax(_all_logits(params(trained), config, chunk), -1))
    held = np.arange(len(tokens) - HELD_OUT, len(tokens))
    answer = (mask[held] > 0) & (np.arange(WINDOW)[None] >= answer_starts[held][:, None] - 1)

    def agreement(trained) -> float:
        guesses = np.concatenate([np.asarray(predict(trained, tokens[held[i : i + 8]])) for i in range(0, HELD_OUT, 8)])
        return float(((guesses == argmax[held]) & answer).sum() / answer.sum())

    trained = {"layers": teacher.params.layers[:layers], "final_norm": teacher.params.final_norm}
    print(f"agreement before training: {agreement(trained):.3f}")
    state = optimizer.init(trained)
    rng = np.random.default_rng(0)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < minutes * 60:
        rows = rng.choice(len(tokens) - HELD_OUT, BATCH, replace=False)
        trained, state, value = step(trained, state, tokens[rows], probs[rows], ids[rows], mask[rows])
        steps += 1
        if steps % 250 == 0:
            print(f"step {steps}: loss {float(value):.3f}, {time.perf_counter() - start:.0f} s, "
                  f"agreement {agreement(trained):.3f}")
    print(f"trained {steps} steps in {time.perf_counter() - start:.0f} s: agreement {agreement(trained):.3f}")
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--answer-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    teacher = load_model(DEFAULT_MODEL)  # float32: labels and the draft's starting point
    served = load_model(DEFAULT_MODEL, keep_blocks=keep_gguf_blocks("auto", "float32", 1))
    tokens, mask, starts = make_data(served, args.prompts, args.answer_tokens)
    labels = teacher_labels(teacher, tokens)
    trained = distill(teacher, args.layers, args.minutes, tokens, mask, starts, labels)

    cut = served.first_layers(args.layers)
    distilled = dataclasses.replace(
        cut, name=f"{served.name}[distilled {args.layers}]",
        params=dataclasses.replace(cut.params, layers=tuple(trained["layers"]), final_norm=trained["final_norm"]))
    proposers = {"none": None, "distilled": dict(method="draft", model=distilled),
                 f"layers-{args.layers}": dict(method="draft", num_layers=args.layers)}
    results = {name: run_proposer(served, spec, args.k, ["chat"], [1, 4], args.new_tokens)
               for name, spec in proposers.items()}
    print(f"{'proposer':12} {'batch':>5} {'tok/s':>7} {'ratio':>6} {'accept':>7} same")
    for name, rows in results.items():
        for (_, batch), row in rows.items():
            base = results["none"][("chat", batch)]
            same = "yes" if row["tokens"] == base["tokens"] else "NO"
            print(f"{name:12} {batch:5d} {row['tok_s']:7.1f} {row['tok_s'] / base['tok_s']:6.2f} "
                  f"{row.get('acceptance', float('nan')):7.2f} {same}")


if __name__ == "__main__":
    main()
