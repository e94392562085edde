"""What the API extras cost on the bundled model, each against plain generation in one process.

1. ``mask``: structured output's per-token grammar mask: output tokens/s of constrained rows
   (a regex the output can follow for the whole length) against the same prompts free, at 1
   and 16 sequences, with 4-step decode (constrained rows force 1 step).
2. ``compile``: compiling a typical JSON schema, cold (a new schema) and cached.
3. ``embed``: embeddings per second for 32 inputs of ~64 tokens in one call.

    python -m raylm.benchmarks.api_features_bench [--parts mask,compile,embed] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import load_model
from raylm.workers.core.grammar import GrammarCompiler, StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

NEW_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                   "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
                   "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                               "required": ["city"]}},
    "required": ["name", "age", "tags"],
}


def mask_cost(llm: LLM, vocab: int, rounds: int) -> None:
    rng = np.random.RandomState(0)
    free = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # Letters and spaces for longer than max_tokens: the grammar never ends a row early.
    constrained = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                 structured_output=StructuredOutput("regex", "[a-z ]{1,1000}"))
    for n in (1, 16):
        prompts = [{"prompt_token_ids": rng.randint(1000, vocab, 64).tolist()} for _ in range(n)]

        def run(params: SamplingParams) -> float:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

        run(free), run(constrained)  # compile
        samples = {"free": [], "constrained": []}
        for i in range(rounds):
            order = [("free", free), ("constrained", constrained)]
            for name, params in order if i % 2 == 0 else order[::-1]:
                samples[name].append(run(params))
        f, c = statistics.median(samples["free"]), statistics.median(samples["constrained"])
        print(f"mask: {n:2d} seqs  free {f:7.1f} out tok/s  constrained {c:7.1f}  ({c / f:.2f}x)")


def compile_cost(llm: LLM) -> None:
    grammars = GrammarCompiler(llm.engine.tokenizer, llm.engine.config.vocab_size, llm.engine.eos_ids)
    start = time.perf_counter()
    grammars.prepare(StructuredOutput("regex", "[0-9]{3}"))  # the tokenizer index, built once per replica
    tokenizer_s = time.perf_counter() - start
    schema = StructuredOutput.json_schema(SCHEMA)
    start = time.perf_counter()
    grammars.prepare(schema)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        grammars.matcher(schema)
    cached = (time.perf_counter() - start) / 100
    print(f"compile: tokenizer index {tokenizer_s * 1e3:.0f} ms once; JSON schema (5 fields, nested) cold "
          f"{cold * 1e3:.2f} ms, cached {cached * 1e3:.3f} ms (a matcher copy)")


def embed_rate(llm: LLM, vocab: int, rounds: int) -> None:
    rng = np.random.RandomState(1)
    inputs = [{"prompt_token_ids": rng.randint(1000, vocab, int(rng.randint(48, 80))).tolist()} for _ in range(32)]
    llm.embed(inputs)  # compile
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        llm.embed(inputs)
        times.append(time.perf_counter() - start)
    print(f"embed: 32 inputs of 48-80 tokens: {32 / statistics.median(times):.1f} embeddings/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="mask,compile,embed")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    parts = args.parts.split(",")
    model = load_model(DEFAULT_MODEL)
    vocab = model.config.vocab_size
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=32, max_model_len=512, num_scheduler_steps=4)
    if "mask" in parts:
        mask_cost(llm, vocab, args.rounds)
    if "compile" in parts:
        compile_cost(llm)
    if "embed" in parts:
        embed_rate(llm, vocab, args.rounds)


if __name__ == "__main__":
    main()
