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
