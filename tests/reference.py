"""Independent references computed with HF transformers (torch) for the exactness tests."""

from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from an HF model, never stopping at EOS (plain argmax, KV-cached)."""
    tokens: list[int] = []
    past = None
    step_input = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out = model(step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            step_input = torch.tensor([[token]])
    return tokens


def hf_greedy_choices(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """HF's argmax after ``prompt`` and each prefix of ``tokens`` (one full forward, no cache):
    ``tokens`` are HF's greedy tokens exactly when this returns them, at the cost of one forward
    instead of one per token (for long generations)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def family_cases(name: str, directory, new_tokens: int) -> tuple:
    """A tiny ``name`` checkpoint in ``directory`` (``tests.checkpoints``), eight prompts of mixed
    lengths (one token, under and over a block, past a small pool) and HF's ``new_tokens``
    greedy continuations of each: ``(path, prompts, continuations)``."""
    import numpy as np

    from tests.checkpoints import build_tiny_checkpoint

    path, hf_model = build_tiny_checkpoint(name, directory)
    rng = np.random.RandomState(1)
    lengths = [1, 15, 17, 40, 90] + rng.randint(2, 120, size=3).tolist()
    prompts = [rng.randint(3, 320, size=n).tolist() for n in lengths]
    return path, prompts, [hf_greedy(hf_model, p, new_tokens) for p in prompts]
