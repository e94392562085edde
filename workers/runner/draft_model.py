"""The draft model of ``speculative.method: draft``: loaded from its own checkpoint, or cut
from the target (its first layers, optionally quantized), sharing the target's tokenizer."""

from __future__ import annotations

import jax

from raylm.model.config.registry import shipped_draft
from raylm.model.loaders.load import LoadedModel, load_model
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.workers.core.speculation import SpeculativeConfig


def load_draft(spec: SpeculativeConfig, target: LoadedModel, float_target: LoadedModel, dtype: str) -> LoadedModel:
    """The draft for ``target`` (as served) described by ``spec``; ``float_target`` is the
    target before weight quantization, which a draft with its own scheme is cut from."""
    if spec.model is not None:
        draft = (spec.model.quantized(spec.quantization) if isinstance(spec.model, LoadedModel)
                 else load_model(spec.model, dtype, spec.quantization))
        if spec.num_layers is not None:
            draft = draft.first_layers(spec.num_layers)
        _check_vocabulary(draft, target)
        return draft
    num_layers, quantization = spec.num_layers, spec.quantization
    if num_layers is None and quantization is None:
        recipe = shipped_draft(float_target.name)
        if recipe is None:
            raise ValueError(
                f"speculative.method draft needs a draft: name one with speculative.model, or cut one from "
                f"{target.name} with speculative.num_layers (no draft ships for it)"
            )
        num_layers, quantization = recipe
        if quantization is not None and quantization == target.quantization and num_layers is None:
            raise ValueError(
                f"the draft shipped for {float_target.name} is its {quantization} copy, and {target.name} is "
                f"already served {quantization}: that draft would cost as much as the model. Use "
                "speculative.method: ngram, or name a smaller draft with speculative.model"
            )
        if quantization is not None and num_layers is None and _holds_gguf_blocks(target):
            # Measured (speculative_bench, 2-core AVX-512, chat prompts, one stream): 0.71x plain
            # decoding against the blocks, 1.29x against the float32 expansion.
            raise ValueError(
                f"the draft shipped for {float_target.name} is its {quantization} copy, which reads more bytes "
                f"per step than {target.name} served as GGUF blocks (model.gguf_blocks): it would slow decoding "
                "down (0.71x measured). Use speculative.method: ngram, name a smaller draft with "
                "speculative.model, or serve the float32 expansion (model.gguf_blocks: expand), which this "
                "draft speeds up"
            )
    source = target if quantization in (None, target.quantization) else float_target
    draft = source.first_layers(num_layers or source.config.num_layers)
    return draft.quantized(quantization) if quantization is not None else draft


def _holds_gguf_blocks(model: LoadedModel) -> bool:
    """Whether ``model`` serves GGUF matrices as stored blocks (4-8 bits per weight)."""
    leaves = jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, GgufBlocks))
    return any(isinstance(leaf, GgufBlocks) for leaf in leaves)


def _check_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Guesses are token ids: a draft must share the target's vocabulary."""
    sizes = (draft.config.vocab_size, target.config.vocab_size)
    if sizes[0] != sizes[1] or draft.tokenizer.vocab_size != target.tokenizer.vocab_size:
        raise ValueError(
            f"draft model {draft.name} has a vocabulary of {sizes[0]} tokens (tokenizer "
            f"{draft.tokenizer.vocab_size}) but {target.name} has {sizes[1]} (tokenizer "
            f"{target.tokenizer.vocab_size}): a draft must share the target's tokenizer"
        )
