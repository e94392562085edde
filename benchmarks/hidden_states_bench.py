"""What hidden-state extraction costs: output tokens/s with and without capturing, same engine.

One ``workers.LLM`` on the bundled model with hidden-state buffers; each round generates the
same prompts plainly and capturing (every layer, or a few, the prompt included), in
alternating order, after a first round compiled both program variants. Reports medians and
the ratio captured / plain (goal: close to 1; the capture writes every layer's residual
stream to device buffers inside the jitted steps and transfers once per request).

    python -m raylm.benchmarks.hidden_states_bench [--seqs 1,4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

PROMPT_LEN, NEW_TOKENS = 128, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(s) for s in args.seqs.split(",")]
    model = load_model(DEFAULT_MODEL)
    L = model.config.num_layers
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=max(counts), max_model_len=512,
              num_scheduler_steps=4, hidden_state_slots=max(counts), hidden_state_max_tokens=PROMPT_LEN + NEW_TOKENS)
    rng = np.random.RandomState(0)
    variants = {
        "plain": {},
        "3 layers": {"return_hidden_states": [L // 2, L - 1, L]},
        f"all {L + 1} layers + prompt": {"return_hidden_states": list(range(L + 1)),
                                         "hidden_states_include_prompt": True},
    }
    print(f"bundled model, {PROMPT_LEN}-token prompts, {NEW_TOKENS} output tokens, out tok/s (median of "
          f"{args.rounds})")
    for n in counts:
        prompts = [{"prompt_token_ids": rng.randint(1000, model.config.vocab_size, PROMPT_LEN).tolist()}
                   for _ in range(n)]

        def run(extra: dict) -> float:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **extra)
            start = time.perf_counter()
            llm.generate(prompts, params)
            return n * NEW_TOKENS / (time.perf_counter() - start)

        for extra in variants.values():
            run(extra)  # compile
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.rounds):
            for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
                samples[name].append(run(variants[name]))
        plain = statistics.median(samples["plain"])
        for name, values in samples.items():
            tok_s = statistics.median(values)
            print(f"  {n:>2} seqs  {name:<26} {tok_s:8.1f}  ({tok_s / plain:.2f}x plain)")


if __name__ == "__main__":
    main()
