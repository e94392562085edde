"""The text decoder of a multimodal checkpoint, served as the text model it is.

Why: the checkpoints released for Llama 4, Gemma 3 (4B and up), Mistral Small 3.1+ and the Qwen
VL models (Qwen3-VL-MoE too) are their ``*ForConditionalGeneration`` classes: a vision tower and a projector beside
a text decoder that is exactly one of raylm's families (HF builds it as ``Llama4ForCausalLM`` /
``Gemma3ForCausalLM`` / ``MistralForCausalLM`` / ... from the nested ``text_config``). On text
input the wrapper's logits are the decoder's, so raylm reads the decoder's config and tensors
(model/loaders/text_decoder_names.py) and never the vision ones; a request with an image part
is refused by the router ("this model reads text only").

The Qwen VL models rotate with M-RoPE: three position ids per token (time, height, width), each
turning its own section of the frequencies. A text token's three ids are its position, so on
text M-RoPE is 1-D RoPE; their configs' ``mrope`` RoPE type reads as the default one. Qwen2-VL
and Qwen2.5-VL configs written before ``text_config`` keep the decoder's keys at the top level.
"""

from __future__ import annotations

from typing import Any, Mapping

from raylm.model.errors import ModelLoadError, UnsupportedModelError

# A wrapper's architecture name -> its text_config's model types -> the family raylm runs it as.
# LLaVA-style wrappers hold whichever decoder their text_config names.
TEXT_DECODERS: dict[str, dict[str, str]] = {
    "Llama4ForConditionalGeneration": {"llama4_text": "Llama4ForCausalLM"},
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM"},
    "LlavaForConditionalGeneration": {
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    },
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_vl": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
    "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
}
# Wrappers whose older configs hold the decoder's keys at the top level (no text_config).
_FLAT = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# What a decoder's config says that HF's wrapper does not follow: Qwen3-VL-MoE's router always
# renormalizes its top-k probabilities (whatever ``norm_topk_prob`` says, or when it is absent).
_WRAPPER_FIXED: dict[str, dict[str, Any]] = {"qwen3_vl_moe_text": {"norm_topk_prob": True}}
# Top-level keys that hold for the decoder too: HF ties the LM head by the wrapper's flag.
# (A top-level quantization_config is read from config.json itself: hf_quantized.py.)
_SHARED_KEYS = ("tie_word_embeddings",)


def wrapped_architecture(raw: Mapping[str, Any]) -> str | None:
    """The multimodal wrapper ``raw`` (a config.json) names, or None for a plain text model."""
    return next((a for a in raw.get("architectures") or () if a in TEXT_DECODERS), None)


def text_decoder_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The config.json of the text decoder inside the multimodal checkpoint ``raw``: its
    ``text_config`` with the family raylm runs as its architecture, and the wrapper's keys
    that hold for the decoder too."""
    wrapper = wrapped_architecture(raw)
    if wrapper is None:
        raise ValueError("not a multimodal wrapper's config")
    text = raw.get("text_config")
    if text is None and wrapper in _FLAT:
        text = {key: value for key, value in raw.items() if key != "vision_config"}
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: {wrapper} without a text_config object")
    model_type = text.get("model_type")
    decoders = TEXT_DECODERS[wrapper]
    if model_type not in decoders:
        raise UnsupportedModelError(
            f"{source}: {wrapper}'s text decoder is {model_type!r}; raylm serves the text decoder of a "
            f"{wrapper} when it is {', '.join(decoders)}"
        )
    merged = {**text, "architectures": [decoders[model_type]], **_WRAPPER_FIXED.get(model_type, {})}
    merged.update({key: raw[key] for key in _SHARED_KEYS if key in raw})
    for key in ("rope_scaling", "rope_parameters"):  # M-RoPE on text is 1-D RoPE (above)
        rope = merged.get(key)
        if isinstance(rope, Mapping) and "mrope" in (rope.get("type"), rope.get("rope_type")):
            merged[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return merged
