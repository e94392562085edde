"""A model without its weights: config and tokenizer, all a front end needs (no JAX).

The router tokenizes, renders chat templates and checks prompt lengths with these; only a
worker replica loads the weights (``model/loaders/load.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raylm.model.config.model_config import ModelConfig
from raylm.model.config.registry import resolve_model_path
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.text.tokenizer import Tokenizer


def load_tokenizer(path: str | Path | GGUFFile, config: ModelConfig | None = None) -> Tokenizer:
    """The tokenizer stored with a checkpoint (tokenizer.json, or the GGUF's vocab)."""
    if isinstance(path, GGUFFile):
        return Tokenizer.from_gguf_fields(path.fields, str(path.path))
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids if config else ())
    return load_tokenizer(GGUFFile(path))


@dataclasses.dataclass
class ModelInfo:
    """What a front end needs without the weights: hyper-parameters and tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer


def load_model_info(name_or_path: str | Path) -> ModelInfo:
    """Config and tokenizer of a model (the router tokenizes; it never loads weights)."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        config = ModelConfig.from_hf_dir(path)
        tokenizer = load_tokenizer(path, config)
    elif path.suffix == ".gguf":
        source = GGUFFile(path)
        config, tokenizer = source.config(), load_tokenizer(source)
    else:
        raise ModelLoadError(f"{path} is neither an HF checkpoint directory nor a .gguf file")
    return ModelInfo(str(name_or_path), path, with_tokenizer_eos(config, tokenizer), tokenizer)


def with_tokenizer_eos(config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """EOS ids are the union of the config's and the tokenizer's (GGUF files split them)."""
    return dataclasses.replace(config, eos_token_ids=tuple(sorted(set(config.eos_token_ids) | tokenizer.eos_token_ids)))
