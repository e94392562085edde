"""Tiny LoRA adapters in PEFT's file format, written by hand (peft is not a dependency), and
their reference: the HF model with each adapter merged into its weights in torch
(``W + scale * B @ A``, what PEFT's ``merge_and_unload`` computes)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors.numpy import save_file

MODULES = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


def lora_key(layer: int, target: str, half: str) -> str:
    """PEFT's name of a layer's ``lora_A`` / ``lora_B`` matrix (``half``: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{MODULES[target]}.{target}.lora_{half}.weight"


def write_adapter(
    directory: Path, hf_model: Any, rank: int, alpha: float, targets: Sequence[str], seed: int,
    use_rslora: bool = False, layers: Sequence[int] | None = None, values_of: str | None = None, **config: Any,
) -> tuple[Path, Any]:
    """Write a random adapter of ``hf_model`` (every layer, or ``layers``) into ``directory``;
    return it and the merged torch model. ``values_of``: "bfloat16" makes every A and B value
    one bfloat16 holds exactly, "int8" one that int8 holds with a scale per row of A and per
    output (row) of B (absmax / 127); with a power-of-two scale, slots of that type then hold the
    adapter exactly. ``config`` adds or overrides adapter_config.json keys."""
    rng = np.random.RandomState(seed)
    merged = copy.deepcopy(hf_model)
    scale = alpha / (math.sqrt(rank) if use_rslora else rank)
    tensors = {}
    num_layers = hf_model.config.num_hidden_layers
    for layer in range(num_layers) if layers is None else layers:
        for target in targets:
            module = getattr(getattr(merged.model.layers[layer], MODULES[target]), target)
            out_features, in_features = module.weight.shape
            a = (rng.randn(rank, in_features) * 0.2).astype(np.float32)
            b = (rng.randn(out_features, rank) * 0.2).astype(np.float32)
            if values_of == "bfloat16":
                a, b = (torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy() for v in (a, b))
            elif values_of == "int8":
                a, b = (_on_int8_grid(v) for v in (a, b))
            tensors[lora_key(layer, target, "A")], tensors[lora_key(layer, target, "B")] = a, b
            with torch.no_grad():
                module.weight.add_(scale * torch.from_numpy(b) @ torch.from_numpy(a))
    directory.mkdir(parents=True, exist_ok=True)
    settings = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
        "target_modules": list(targets), "bias": "none", "modules_to_save": None, "use_dora": False,
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM", **config,
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory, merged.eval()


def _on_int8_grid(values: np.ndarray) -> np.ndarray:
    """Each row of ``values`` rounded to a multiple of its own absmax / 127 (float32)."""
    scale = (np.abs(values).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    return (np.rint(values / scale) * scale).astype(np.float32)
