"""llama.cpp's own integer-activation effect, to read raylm's integer compute mode against.

llama-server computes Q4_1 blocks against int8 activations (its q8_1 scheme); from an F32
copy of the same weights (``../shared/peers/llama-server.sh build`` makes one from the Q4_1
file) it computes in float. Greedy continuations of ``quantization_bench``'s 20 chat-templated
reference prompts (32 tokens, EOS ignored) from both, compared as ``quantization_bench``
compares raylm's integer mode with its exact mode; and raylm's exact mode against llama-server
F32 for scale (float sums in another order).

    ../shared/peers/llama-server.sh serve Q4_1 1 8091 &  ../shared/peers/llama-server.sh serve F32 1 8092 &
    python -m raylm.benchmarks.llama_cpp_agreement http://127.0.0.1:8091 http://127.0.0.1:8092
"""

from __future__ import annotations

import argparse

import httpx

from raylm.benchmarks.quantization_bench import AGREEMENT_TOKENS, FIRST_TOKENS, REFERENCE_PROMPTS
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM


def llama_greedy(url: str, prompt: list[int]) -> list[int]:
    """llama-server's greedy tokens for ``prompt`` (token ids), through its native /completion."""
    body = {"prompt": prompt, "n_predict": AGREEMENT_TOKENS, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False}
    response = httpx.post(f"{url}/completion", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["tokens"]


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    full = sum(x == y for x, y in zip(a, b))
    first = sum(x[:FIRST_TOKENS] == y[:FIRST_TOKENS] for x, y in zip(a, b))
    return f"{full} of {len(a)} identical, {first} of {len(a)} identical in their first {FIRST_TOKENS} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("q4_1_url")
    parser.add_argument("f32_url")
    args = parser.parse_args()
    model = load_model(DEFAULT_MODEL)
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in REFERENCE_PROMPTS]
    q4_1 = [llama_greedy(args.q4_1_url, p) for p in prompts]
    f32 = [llama_greedy(args.f32_url, p) for p in prompts]
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
    exact = [o.outputs[0].token_ids for o in LLM(model).generate([{"prompt_token_ids": p} for p in prompts], params)]
    print(f"llama-server Q4_1 (int8 activations) against llama-server F32: {agreement(q4_1, f32)}")
    print(f"raylm exact mode against llama-server F32: {agreement(exact, f32)}")


if __name__ == "__main__":
    main()
