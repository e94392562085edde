"""A multimodal checkpoint's text-decoder tensors under the names of a plain text checkpoint.

Why: the released Llama 4, Gemma 3 and Mistral 3 checkpoints store their decoder under
``language_model.model.*`` and ``language_model.lm_head.*`` (the hub's layout, which
transformers 5 writes too); checkpoints saved by transformers 4.52-4.57 use
``model.language_model.*`` with a top-level ``lm_head.*``. The loader asks for the text
layout (``model.layers.0...``, ``lm_head.weight``); everything else (``vision_model``,
``vision_tower``, ``multi_modal_projector``) is left unread (model/config/text_decoder.py).
"""

from __future__ import annotations

from typing import Iterable

# (stored prefix, text-layout prefix), the hub's layout first.
_DECODER_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)


def text_decoder_names(stored: Iterable[str]) -> dict[str, str]:
    """Text-layout name -> stored name for the decoder's tensors among ``stored`` (a
    multimodal checkpoint's tensor names); the vision tower's and projector's are left out."""
    names: dict[str, str] = {}
    for name in stored:
        for prefix, text_prefix in _DECODER_PREFIXES:
            if name.startswith(prefix):
                names.setdefault(text_prefix + name[len(prefix):], name)
                break
    return names
