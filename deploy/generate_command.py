"""``raylm generate``: stream a completion of one prompt to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.errors import ModelError
from raylm.model.loaders.load import GGUF_BLOCKS_CHOICES, keep_gguf_blocks, load_model
from raylm.model.quantization.activations import ACTIVATION_QUANTIZATIONS
from raylm.model.quantization.quant_array import SCHEMES
from raylm.model.runtime.buckets import cdiv
from raylm.model.runtime.compilation_cache import enable_compilation_cache
from raylm.model.text.chat_template import ChatTemplateError
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import LLMEngine


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF checkpoint dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", choices=SCHEMES, default="none",
                   help="weight-only 8-bit matrices with per-output-channel scales")
    p.add_argument("--activation-quantization", choices=ACTIVATION_QUANTIZATIONS, default="none",
                   help="int8: the integer compute mode for GGUF block and int8 weights (faster, not exact)")
    p.add_argument("--gguf-blocks", choices=GGUF_BLOCKS_CHOICES, default="auto",
                   help="a GGUF's block-quantized matrices kept as stored (exact) or expanded to float32")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (local devices)")
    p.add_argument("--speculative-method", choices=["draft", "ngram"], default=None,
                   help="speculative decoding (default: off; draft when --speculative-model is given)")
    p.add_argument("--speculative-model", default=None,
                   help="draft model (registry name, .gguf, HF dir); default: the model's shipped draft")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="guesses verified per step")
    p.set_defaults(run=run_generate)


def _speculative(args: argparse.Namespace) -> dict | None:
    method = args.speculative_method or ("draft" if args.speculative_model else None)
    if method is None:
        return None
    spec = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative_model:
        spec["model"] = args.speculative_model
    return spec


@contextmanager
def _step(message: str) -> Iterator[None]:
    """Say what is happening on stderr, and how long it took, so stdout stays the text."""
    print(f"{message} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f" done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed,
        )
        enable_compilation_cache()
        quantized = "" if args.quantization == "none" else f", {args.quantization} weights"
        if args.activation_quantization != "none":
            quantized += f", {args.activation_quantization} activations"
        with _step(f"loading {args.model} ({args.dtype}{quantized})"):
            keep_blocks = keep_gguf_blocks(args.gguf_blocks, args.dtype, args.tp)
            model = load_model(args.model, args.dtype, args.quantization, keep_blocks)
        tokenizer = model.tokenizer
        if args.chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        block_size = EngineArgs.block_size
        speculative = _speculative(args)
        lookahead = args.num_speculative_tokens if speculative else 0
        engine = LLMEngine(
            model,
            EngineArgs(
                dtype=args.dtype, quantization=args.quantization, gguf_blocks=args.gguf_blocks, tensor_parallel_size=args.tp, max_num_seqs=1,
                activation_quantization=args.activation_quantization,
                num_kv_blocks=2 + cdiv(len(prompt_ids) + args.max_tokens + lookahead, block_size),
                speculative=speculative,
            ),
        )
        engine.add_request("cli", prompt_ids, params)
        with _step(f"compiling and prefilling {len(prompt_ids)} prompt tokens"):
            outputs = engine.step()
        start, count = time.perf_counter(), 0
        while True:
            for out in outputs:
                completion = out.outputs[0]
                count = len(completion.token_ids)
                sys.stdout.write(completion.text_delta)
                sys.stdout.flush()
            if not engine.has_unfinished_requests():
                break
            outputs = engine.step()
        sys.stdout.write("\n")
        elapsed = time.perf_counter() - start
        rate = f"{max(count - 1, 0) / max(elapsed, 1e-9):.1f} tokens/s after the first"
        spec = engine.stats().spec
        if spec is not None:
            rate += f", {spec.num_accepted_tokens}/{spec.num_draft_tokens} guesses accepted"
        print(f"[{count} tokens, {rate}]", file=sys.stderr)
        return 0
    except (ModelError, ChatTemplateError, ValueError) as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 2
