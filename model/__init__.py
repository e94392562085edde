"""Pure JAX Llama-family models: config, paged forward pass, weight loading, tokenizer, sharding.

Knows nothing of Ray or HTTP; the engine (``workers``) builds on these names.
"""

from model.attention import KVCache
from model.config import ModelConfig, RopeScaling
from model.detokenizer import IncrementalDetokenizer
from model.errors import ModelError, ModelLoadError, PromptTooLongError, UnsupportedModelError
from model.forward import forward
from model.generate import SingleSequenceGenerator
from model.loader import LoadedModel, ModelInfo, load_checkpoint, load_model, load_model_info, load_tokenizer, parse_dtype
from model.params import LayerParams, ModelParams
from model.registry import BUNDLED_MODELS, DEFAULT_MODEL, resolve_model_path
from model.sampling import SimpleSampling
from model.sharding import make_mesh, shard_params
from model.tokenizer import Tokenizer

__all__ = [
    "BUNDLED_MODELS", "DEFAULT_MODEL", "IncrementalDetokenizer", "KVCache", "LayerParams", "LoadedModel",
    "ModelConfig", "ModelError", "ModelInfo", "ModelLoadError", "ModelParams", "PromptTooLongError", "RopeScaling",
    "SimpleSampling", "SingleSequenceGenerator", "Tokenizer", "UnsupportedModelError",
    "forward", "load_checkpoint", "load_model", "load_model_info", "load_tokenizer", "make_mesh", "parse_dtype",
    "resolve_model_path", "shard_params",
]
