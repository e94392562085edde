"""The text decoder of a multimodal checkpoint, served as the text model it is.

Why: the checkpoints Meta, Google and Mistral release for Llama 4, Gemma 3 (4B and up) and
Mistral Small 3.1+ are their ``*ForConditionalGeneration`` classes: a vision tower and a
projector beside a text decoder that is exactly one of raylm's families (HF builds it as
``Llama4ForCausalLM`` / ``Gemma3ForCausalLM`` / ``MistralForCausalLM`` from the nested
``text_config``). On text input the wrapper's logits are the decoder's, so raylm reads the
decoder's config and tensors (model/loaders/text_decoder_names.py) and never the vision ones;
a request with an image part is refused by the router ("this model reads text only").
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
}
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
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: {wrapper} without a text_config object")
    model_type = text.get("model_type")
    decoders = TEXT_DECODERS[wrapper]
    if model_type not in decoders:
        raise UnsupportedModelError(
            f"{source}: {wrapper}'s text decoder is {model_type!r}; raylm serves the text decoder of a "
            f"{wrapper} when it is {', '.join(decoders)}"
        )
    merged = {**text, "architectures": [decoders[model_type]]}
    merged.update({key: raw[key] for key in _SHARED_KEYS if key in raw})
    return merged
