"""Serve one checkpoint twice, its matrices kept as stored and expanded at load (test support).

What a stored form must not change is what the engine produces: the same tokens and logprobs,
batched (a short prompt, one longer than the small-batch kernel takes, another short one) and
alone. Returns each choice's outputs and weight bytes, for the caller's assertions.
"""

from __future__ import annotations

from pathlib import Path

from raylm.model.quantization.quant_array import weight_bytes
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.fast_compile import fusion_emitters

PROMPTS = [[5, 9, 77, 31, 8], list(range(3, 80)), [100, 200, 300, 11]]


def served_kept_and_expanded(path: Path) -> tuple[dict[str, list], dict[str, int]]:
    """``({"keep": runs, "expand": runs}, {"keep": bytes, "expand": bytes})`` for ``path``."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    runs, sizes = {}, {}
    for choice in ("keep", "expand"):
        with fusion_emitters():  # the callers assert the floats equal: compiled as served
            llm = LLM(str(path), gguf_blocks=choice, max_model_len=128, num_kv_blocks=48)
            outputs = [*llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params),
                       *llm.generate([{"prompt_token_ids": PROMPTS[1]}], params)]
        runs[choice] = [(c.token_ids, c.logprobs) for out in outputs for c in out.outputs]
        sizes[choice] = weight_bytes(llm.engine.model.params)
    return runs, sizes
