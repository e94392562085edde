"""Load an HF checkpoint directory: ``config.json`` + one or sharded ``*.safetensors`` files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from raylm.model.config.families import HF_FAMILIES
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.hf_tensors import build_params

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {err}") from None
        return {name: path / file for name, file in weight_map.items()}
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (expected {SINGLE_FILE} or {INDEX_FILE})")
    names: dict[str, Path] = {}
    for file in files:
        with _open(file) as handle:
            names.update({name: file for name in handle.keys()})
    return names


def _open(file: Path):
    if not file.is_file():
        raise ModelLoadError(f"weights file {file} is missing")
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {file}: {err} (truncated or not a safetensors file?)") from None


def load_safetensors_checkpoint(
    path: str | Path, dtype: jnp.dtype = jnp.float32
) -> tuple[ModelConfig, ModelParams]:
    """Read config and weights of an HF checkpoint directory of a supported architecture."""
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    names = _tensor_files(path)
    if config.tie_word_embeddings is False and "lm_head.weight" not in names:
        # Some exports omit lm_head without saying the embeddings are tied.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in set(names.values())}

        def get(name: str) -> np.ndarray | None:
            file = names.get(name)
            if file is None:
                return None
            try:
                return _to_float(handles[file].get_tensor(name))
            except (SafetensorError, OSError, ValueError) as err:
                raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {err}") from None

        params = build_params(config, get, str(path), dtype, norm_offset=1.0 if HF_FAMILIES[config.architecture].gemma else 0.0)
    return config, params


def _to_float(array: np.ndarray) -> np.ndarray:
    """numpy cannot do arithmetic on ml_dtypes' bfloat16 everywhere; widen to float32."""
    return array if array.dtype == np.float32 else array.astype(np.float32)
