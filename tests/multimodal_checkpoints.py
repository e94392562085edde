"""Tiny multimodal checkpoints (a vision tower and projector beside a text decoder of one of
raylm's families), written by transformers as the released Llama 4 / Gemma 3 / Mistral 3 /
LLaVA / Qwen VL checkpoints are, for the tests of serving their text decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.numpy import load_file, save_file

from tests.checkpoints import TINY_BASE, TINY_VARIANTS, tiny_tokenizer

_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
               patch_size=14)


def _configs() -> dict[str, Any]:
    text = {name: {**TINY_BASE, **TINY_VARIANTS[name][1]} for name in ("llama4", "gemma3", "mistral-sliding", "qwen2")}
    return {
        "llama4": transformers.Llama4Config(
            vision_config=dict(_VISION, projector_input_dim=64, projector_output_dim=64, vision_output_dim=64),
            text_config=text["llama4"], tie_word_embeddings=False,
        ),
        "gemma3": transformers.Gemma3Config(vision_config=_VISION, text_config=text["gemma3"], mm_tokens_per_image=4),
        "mistral3": transformers.Mistral3Config(
            vision_config=dict(_VISION, head_dim=16, model_type="pixtral"),
            text_config={**text["mistral-sliding"], "model_type": "mistral"}, tie_word_embeddings=False,
        ),
        "llava-qwen2": transformers.LlavaConfig(
            vision_config=dict(_VISION, model_type="clip_vision_model", projection_dim=32),
            text_config={**text["qwen2"], "model_type": "qwen2"},
            image_token_index=5,
        ),
        # M-RoPE over head_dim 16: sections of 2 + 3 + 3 frequencies.
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig(
            text_config={**text["qwen2"], "rope_parameters": _MROPE},
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
        ),
        "qwen3_vl": transformers.Qwen3VLConfig(
            text_config={**TINY_BASE, "head_dim": 16, "rope_parameters": _MROPE},
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                               deepstack_visual_indexes=[0]),
        ),
        # Experts stacked (experts.gate_up_proj / down_proj), D = 64 beside 2I = 48: not square.
        # Its router renormalizes the top-k whatever norm_topk_prob says.
        "qwen3_vl_moe": transformers.Qwen3VLMoeConfig(
            text_config={**TINY_BASE, **TINY_VARIANTS["qwen3-moe"][1], "head_dim": 16, "moe_intermediate_size": 24,
                         "norm_topk_prob": False, "rope_parameters": _MROPE},
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                               deepstack_visual_indexes=[0]),
        ),
    }


_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


MULTIMODAL_VARIANTS = ("llama4", "gemma3", "mistral3", "llava-qwen2", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_MODELS = {
    "llama4": transformers.Llama4ForConditionalGeneration,
    "gemma3": transformers.Gemma3ForConditionalGeneration,
    "mistral3": transformers.Mistral3ForConditionalGeneration,
    "llava-qwen2": transformers.LlavaForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
}


def build_tiny_multimodal_checkpoint(variant: str, directory: Path, seed: int = 0) -> tuple[Path, Any]:
    """Write ``variant`` (one of ``MULTIMODAL_VARIANTS``) as transformers saves it into
    ``directory``; return (dir, torch model). Norms and biases are perturbed away from their
    initial values so that a tensor read from the wrong place shows in the logits."""
    config = _configs()[variant]
    config.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _MODELS[variant](config).eval().to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.1 * torch.randn_like(param))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer(config.get_text_config().vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return directory, model


def resave_with_transformers_4_names(directory: Path) -> None:
    """Rename the checkpoint's tensors as transformers 4.52-4.57 saved them: the decoder under
    ``model.language_model.``, the LM head at the top level, the rest under ``model.``."""
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    renamed = {}
    for name, array in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        else:
            name = "model." + name
        renamed[name] = array
    save_file(renamed, str(file), metadata={"format": "pt"})
