"""LoRA adapters on the bundled model: what serving adapters costs against the base model alone.

Random PEFT adapters of rank ``--ranks`` on all seven projections of every layer are written to
a temporary directory; for each rank one engine with ``enable_lora`` (``max_loras`` =
``--adapters``) is timed against an engine without LoRA, in the same process, alternating
rounds (output tokens/s, greedy, EOS ignored, prefill included; a warm-up round compiles
everything first):

- ``single``: one request at a time, with an adapter, against the base engine's;
- ``decode``: the same requests' decode alone, after each one's first token: output tokens
  past the first over the time from the first token to the last (``single`` also counts each
  request's prompt and first step, which weigh more the fewer tokens it generates);
- ``batch``: ``--batch`` requests at once spread over ``--adapters`` adapters, against the
  same requests on the base engine;
- ``load``: reading an adapter from disk, and the first token of a request whose adapter is
  not resident (its slot filled in that step), against one whose adapter is.

The base model keeps its GGUF blocks as serving does by default (``--base float32``: its weights
dequantized, against which an adapter's bytes weigh less). ``--model`` times another model (a
registry name, an HF checkpoint directory or a GGUF file) in ``--dtype``: on an accelerator, say,
where the bundled model's blocks are not what serving would run.

    python -m raylm.benchmarks.lora_bench [--ranks 8,64] [--adapters 8] [--batch 16] [--rounds 3]
        [--lora-dtype bfloat16] [--base blocks|float32] [--model NAME_OR_PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from raylm.model.config.model_config import ModelConfig
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import load_model
from raylm.model.loaders.lora_adapter import TARGETS, load_lora_adapter
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM


def write_random_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter of ``rank`` on every projection of every layer, small random weights."""
    rng = np.random.RandomState(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name, target in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.{target.module}.lora_"
            tensors[key + "A.weight"] = (rng.randn(rank, np.prod(target.in_shape(config))) * 0.01).astype(np.float32)
            tensors[key + "B.weight"] = (rng.randn(np.prod(target.out_shape(config)), rank) * 0.01).astype(np.float32)
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS), "bias": "none"}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _tokens_per_s(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], new_tokens: int,
                  one_at_a_time: bool) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    if one_at_a_time:
        for prompt, lora in zip(prompts, loras):
            llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora)
    else:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def _decode_tokens_per_s(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
                         new_tokens: int) -> float:
    """One request at a time: output tokens after the first over the time from the step that
    produced the first token to the one that finished the request."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens, seconds = 0, 0.0
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"decode-{i}", prompt, params, lora_request=lora)
        first, first_count, generated = None, 0, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                generated = len(output.outputs[0].token_ids)
            if first is None and generated:
                first, first_count = time.perf_counter(), generated
        tokens += generated - first_count
        seconds += time.perf_counter() - first
    return tokens / seconds


def _first_token_s(llm: LLM, prompt: list[int], lora: LoRARequest) -> float:
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request("first", prompt, SamplingParams(max_tokens=1, temperature=0.0), lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lora-dtype", default=None, help="the slots' type (engine.lora_dtype; default the model's)")
    parser.add_argument("--base", choices=("blocks", "float32"), default="blocks",
                        help="the base model's weights: its GGUF blocks as stored (what serving keeps by default) "
                             "or dequantized (a GGUF model's; other checkpoints have no blocks)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a registry name, HF checkpoint directory or GGUF file")
    parser.add_argument("--dtype", default="float32", help="the base model's compute type (float32, bfloat16)")
    args = parser.parse_args()

    model = load_model(args.model, args.dtype, keep_blocks=args.base == "blocks")
    config = model.config
    engine_args = dict(max_num_seqs=args.batch, num_kv_blocks=args.batch * 8 + 8, max_model_len=256)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1000, 20000, args.prompt).tolist() for _ in range(args.batch)]
    base = LLM(model, **engine_args)
    print(f"{args.model} ({args.dtype}, {jax.default_backend()}), {args.adapters} adapters on q/k/v/o/gate/up/down, "
          f"{args.batch} requests of {args.prompt} + {args.new_tokens} tokens, slots "
          f"{args.lora_dtype or 'of the model dtype'}; tokens/s with LoRA / without (median of {args.rounds} rounds)")
    with tempfile.TemporaryDirectory() as root:
        for rank in [int(r) for r in args.ranks.split(",")]:
            requests = [LoRARequest(f"r{rank}-{i}", i + 1, str(write_random_adapter(
                Path(root) / f"r{rank}-{i}", config, rank, i))) for i in range(args.adapters + 1)]
            served, spare = requests[:-1], requests[-1]
            lora = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=rank, lora_dtype=args.lora_dtype,
                       **engine_args)
            spread = [served[i % len(served)] for i in range(args.batch)]
            single = prompts[: args.single_requests]

            def loras(count: int, with_lora: bool) -> list[LoRARequest | None]:
                """The first ``count`` prompts' adapters, or none for the base engine."""
                return spread[:count] if with_lora else [None] * count

            cases = {
                "single": lambda llm, with_lora: _tokens_per_s(
                    llm, single, loras(len(single), with_lora), args.new_tokens, True),
                "decode": lambda llm, with_lora: _decode_tokens_per_s(
                    llm, single, loras(len(single), with_lora), args.new_tokens),
                "batch": lambda llm, with_lora: _tokens_per_s(
                    llm, prompts, loras(len(prompts), with_lora), args.new_tokens, False),
            }
            for name, case in cases.items():
                case(base, False), case(lora, True)  # compile
                ratios, rates = [], []
                for _ in range(args.rounds):
                    without, with_ = case(base, False), case(lora, True)
                    ratios.append(with_ / without)
                    rates.append((with_, without))
                mid = sorted(range(args.rounds), key=lambda i: ratios[i])[args.rounds // 2]
                print(f"rank {rank:>3} {name:<7} {rates[mid][0]:7.1f} / {rates[mid][1]:7.1f} tok/s = "
                      f"{statistics.median(ratios):.2f}x")
            start = time.perf_counter()
            load_lora_adapter(spare.lora_name, spare.lora_path, config, rank)
            read_s = time.perf_counter() - start
            fresh = [rng.randint(1000, 20000, args.prompt).tolist() for _ in range(2)]  # no prefix-cache hit
            resident = _first_token_s(lora, fresh[0], served[0])
            cold = _first_token_s(lora, fresh[1], spare)  # read, evicts a slot and fills it in this step
            print(f"rank {rank:>3} load    read {1e3 * read_s:.0f} ms; first token {1e3 * cold:.0f} ms not resident, "
                  f"{1e3 * resident:.0f} ms resident")


if __name__ == "__main__":
    main()
