"""Pure JAX Llama-family models: config, paged forward pass, weight loading, tokenizer, sharding.

Knows nothing of Ray or HTTP; the engine (``workers``) builds on these names. They load on
first use (PEP 562), so the router can use the tokenizer and config without importing JAX.
The forward pass itself is ``model.forward.forward`` (the module's name would shadow it here).
"""

from __future__ import annotations

from model.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {  # module -> the names it defines
    "attention": ("GroupedKV", "KVCache"),
    "config": ("ModelConfig", "RopeScaling"),
    "detokenizer": ("IncrementalDetokenizer",),
    "errors": ("ModelError", "ModelLoadError", "PromptTooLongError", "UnsupportedModelError"),
    "generate": ("SingleSequenceGenerator",),
    "loader": ("LoadedModel", "load_checkpoint", "load_model", "parse_dtype"),
    "model_info": ("ModelInfo", "load_model_info", "load_tokenizer"),
    "params": ("LayerParams", "ModelParams"),
    "registry": ("BUNDLED_MODELS", "DEFAULT_MODEL", "resolve_model_path"),
    "sampling": ("SimpleSampling",),
    "sharding": ("make_mesh", "shard_params"),
    "tokenizer": ("Tokenizer",),
})
