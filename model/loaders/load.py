"""One entry point to load any supported checkpoint: config, params and tokenizer together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.config.model_info import load_tokenizer, with_tokenizer_eos
from raylm.model.config.registry import resolve_model_path
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.gguf_checkpoint import load_gguf_checkpoint
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.hf_checkpoint import load_safetensors_checkpoint
from raylm.model.loaders.hf_quantized import method_of
from raylm.model.loaders.hf_tensors import PrepareLayer
from raylm.model.quantization.activations import ActivationQuantization, Int8Packer, parse_activation_quantization
from raylm.model.quantization.quant_array import Scheme, parse_quantization, quantize_params
from raylm.model.text.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# What happens to a GGUF's block-quantized matrices (model/quantization/gguf_blocks.py): "keep" them as
# stored (the float32 numbers, a sixth of the bytes; float32 models on one device), "expand"
# them to float32 at load, or "auto": keep them where that is possible and pays (one CPU device).
# The same choice keeps bfloat16 / float16 matrices (GGUF F16 / BF16, 16-bit safetensors) at 16
# bits rather than widening them (model/loaders/hf_tensors.py).
GGUF_BLOCKS_CHOICES: tuple[str, ...] = ("auto", "keep", "expand")


def keep_gguf_blocks(choice: str, dtype: str, num_devices: int) -> bool:
    """Whether to load GGUF matrices as blocks for ``gguf_blocks=choice``; an impossible
    "keep" is an error naming the setting."""
    if choice not in GGUF_BLOCKS_CHOICES:
        raise ValueError(f"gguf_blocks must be one of {', '.join(GGUF_BLOCKS_CHOICES)}, got {choice!r}")
    possible = dtype == "float32" and num_devices == 1
    if choice == "keep" and not possible:
        raise ValueError(
            "gguf_blocks=keep serves a float32 model on one device; got "
            f"dtype={dtype} on {num_devices} devices (tensor x expert parallel; use gguf_blocks=auto or expand)"
        )
    if choice == "auto":
        # On accelerators XLA's dot would dequantize the whole matrix on every call.
        return possible and jax.default_backend() == "cpu"
    return choice == "keep"


@dataclasses.dataclass
class LoadedModel:
    """What a model replica needs: hyper-parameters, weights on device, tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    params: ModelParams
    tokenizer: Tokenizer
    quantization: Scheme | None = None  # weight-only scheme the params were quantized with
    # The quant_method of an HF checkpoint stored quantized (awq, gptq, compressed-tensors, fp8):
    # its matrices are served as the checkpoint defines them, never quantized again.
    checkpoint_quantization: str | None = None
    # A pipeline stage's decoder layers, which ``params`` alone holds (None: the whole model).
    layers: range | None = None
    # "int8": the params are packed for the integer compute mode (model/quantization/activations.py).
    activation_quantization: ActivationQuantization = "none"

    def quantized(self, quantization: str | None) -> "LoadedModel":
        """This model with its matrices quantized by ``quantization`` (``None``/``"none"``: as is).

        Only float weights can be quantized; asking a quantized model for another scheme is an
        error (its float weights are gone), and so is asking it of a checkpoint stored quantized
        (quantizing its 4- or 8-bit weights again would only lose precision)."""
        scheme = parse_quantization(quantization)
        if scheme is not None and self.checkpoint_quantization is not None:
            raise ValueError(_requantize_message(self.name, self.checkpoint_quantization, scheme))
        if scheme == self.quantization:
            return self
        if self.activation_quantization != "none":
            raise ValueError(f"model {self.name} was loaded packed for activation_quantization "
                             f"{self.activation_quantization}; it cannot be quantized as {quantization} (load it with "
                             "the quantization it is served with)")
        if self.quantization is not None:
            raise ValueError(
                f"model {self.name} was loaded with quantization={self.quantization}; it cannot be served as "
                f"quantization={quantization or 'none'} (pass quantization={self.quantization!r}, "
                "or load the float model)"
            )
        return dataclasses.replace(self, params=quantize_params(self.params, scheme), quantization=scheme)

    def first_layers(self, num_layers: int) -> "LoadedModel":
        """This model cut after its first ``num_layers`` decoder layers (final norm and head
        kept): a layer-skipping draft that shares the target's weight arrays, no copy."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"a draft of {num_layers} layers cannot be cut from {self.name} "
                             f"({self.config.num_layers} layers)")
        return dataclasses.replace(
            self,
            name=f"{self.name}[:{num_layers}]",
            config=self.config.first_layers(num_layers),
            params=dataclasses.replace(self.params, layers=self.params.layers[:num_layers]),
        )


def _requantize_message(name: str, method: str, scheme: str) -> str:
    return (f"model {name} is a {method} checkpoint, stored quantized: it is served as its checkpoint defines it "
            f"and cannot be quantized again as {scheme} (leave quantization unset or none)")


def parse_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def load_checkpoint(
    path: str | Path, dtype: str | jnp.dtype = "float32", keep_blocks: bool = False, layers: range | None = None,
    mesh: Mesh | None = None, prepare_layer: PrepareLayer | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Weights and config of a ``.gguf`` file (``keep_blocks``: see load_gguf_checkpoint) or an
    HF safetensors directory (``keep_blocks``: a quantized checkpoint's matrices as stored, see
    load_safetensors_checkpoint); ``layers``: a pipeline stage's decoder layers alone; ``mesh``:
    each layer placed on its shards as it is built, ``prepare_layer``: what it becomes then
    (``build_params``)."""
    path = Path(path)
    if path.is_dir():
        return load_safetensors_checkpoint(path, parse_dtype(dtype), keep_blocks, layers, mesh, prepare_layer)
    if path.suffix == ".gguf":
        return load_gguf_checkpoint(path, parse_dtype(dtype), keep_blocks, layers, mesh, prepare_layer)
    raise ModelLoadError(f"{path} is neither an HF checkpoint directory nor a .gguf file")


def load_model(
    name_or_path: str | Path,
    dtype: str | jnp.dtype = "float32",
    quantization: str | None = None,
    keep_blocks: bool = False,
    layers: range | None = None,
    mesh: Mesh | None = None,
    activation_quantization: str | None = None,
) -> LoadedModel:
    """Resolve a registry name or path and load everything a replica needs, its matrices
    quantized by ``quantization`` (int8 / fp8; see model/quantization/quant_array.py) if given, a GGUF's
    block matrices (and a quantized HF checkpoint's) kept as stored with ``keep_blocks`` (see
    ``keep_gguf_blocks``). With ``layers`` the params are a pipeline stage's (its decoder layers
    alone; ``config`` stays the whole model's). With ``mesh`` (the replica's, of several devices or
    hosts) each layer is placed on its shards as it is built, so no process holds the whole model
    unsharded; a model quantized at load (``quantization``) is placed after it, whole.

    ``activation_quantization`` "int8" packs the matrices for the integer compute mode
    (model/quantization/activations.py): each layer as soon as it is read, so the load holds one
    layer's stored form beside the packed model (after quantizing, for a model quantized at load)."""
    scheme = parse_quantization(quantization)  # a bad name fails before the weights load
    # A bad name, or a kernel that cannot run here, fails before the weights load too.
    packer = Int8Packer() if parse_activation_quantization(activation_quantization) == "int8" else None
    prepare_layer = packer.layer if packer is not None and scheme is None else None
    path = resolve_model_path(name_or_path)
    stored = method_of(path) if path.is_dir() else None
    if scheme is not None and stored is not None:
        raise ValueError(_requantize_message(str(name_or_path), stored, scheme))
    placed_mesh = mesh if scheme is None else None  # (quantizing works on the unsharded matrices)
    source: Path | GGUFFile = path
    if path.suffix == ".gguf" and path.is_file():
        # Parsed once for weights and tokenizer: the reader is slow on large vocabularies.
        source = GGUFFile(path)
        config, params = load_gguf_checkpoint(source, parse_dtype(dtype), keep_blocks, layers, placed_mesh,
                                              prepare_layer)
    else:
        config, params = load_checkpoint(path, dtype, keep_blocks, layers, placed_mesh, prepare_layer)
    tokenizer = load_tokenizer(source, config)
    loaded = LoadedModel(str(name_or_path), path, with_tokenizer_eos(config, tokenizer), params, tokenizer,
                         checkpoint_quantization=stored, layers=layers).quantized(scheme)
    if packer is None:
        return loaded
    params = packer.finish(loaded.params, loaded.name, layers_packed=prepare_layer is not None)
    return dataclasses.replace(loaded, params=params, activation_quantization="int8")
