"""Load an HF checkpoint directory: ``config.json`` + one or sharded ``*.safetensors`` files.

Float tensors are widened to float32 (build_params casts them to the model dtype), except that
with ``keep_blocks`` (a float32 model on one CPU device) bfloat16 and float16 matrices stay
16-bit (model/loaders/hf_tensors.py: the kernels widen them exactly); a checkpoint
stored quantized (``quantization_config``: AWQ, GPTQ, compressed-tensors, FP8, MXFP4) has its layers
read by model/loaders/hf_quantized.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from raylm.model.config.families import HF_FAMILIES
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.fused_experts import fused_experts_tensors
from raylm.model.loaders.hf_quantized import QUANTIZED_SUFFIXES, read_quantization
from raylm.model.loaders.hf_quantized_matrix import Matrix
from raylm.model.loaders.hf_tensors import HALF_DTYPES, PrepareLayer, build_params
from raylm.model.loaders.llama4_tensors import llama4_tensors
from raylm.model.loaders.text_decoder_names import text_decoder_names

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Every tensor is read from the file's bytes with a plain read (``_Tensors.read`` says why), as
# the numpy dtype of its safetensors dtype (safetensors' own numpy reader knows no 8-bit floats).
_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
           "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F32": np.float32, "F64": np.float64, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Names only a multimodal checkpoint's text decoder has (model/loaders/text_decoder_names.py).
_WRAPPED_PREFIXES = ("language_model.", "model.language_model.")


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


class _Tensors:
    """A checkpoint's tensors by name, as stored (model/loaders/hf_quantized.py's ``Tensors``);
    a multimodal checkpoint's decoder tensors by their text-layout names (``stored``: text
    name -> stored name, model/loaders/text_decoder_names.py)."""

    def __init__(self, names: dict[str, Path], handles: dict[Path, object], stored: dict[str, str] | None = None):
        self.names, self.handles, self.stored = names, handles, stored
        self.headers: dict[Path, tuple[int, dict]] = {}

    def _stored(self, name: str) -> str:
        return name if self.stored is None else self.stored[name]

    def dtype(self, name: str) -> str | None:
        file = self.names.get(name)
        if file is None:
            return None
        try:
            return self.handles[file].get_slice(self._stored(name)).get_dtype()
        except (SafetensorError, OSError, ValueError) as err:
            raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {err}") from None

    def read(self, name: str) -> np.ndarray | None:
        """The tensor, read into memory of its own with a plain file read. Why not through
        safetensors' memory map: every page a copy touched stayed mapped, counted in the process's
        RSS until the file was closed at the end of the load (a bfloat16 checkpoint's load peaked
        at its weights plus the whole checkpoint), and read() leaves them in the page cache only."""
        kind = self.dtype(name)
        if kind is None:
            return None
        file = self.names[name]
        try:
            if kind not in _DTYPES:
                raise ValueError(f"safetensors dtype {kind} is not one raylm reads")
            return self._raw(file, self._stored(name), np.dtype(_DTYPES[kind]))
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {err}") from None

    def _raw(self, file: Path, name: str, dtype: np.dtype) -> np.ndarray:
        """A tensor from the file's bytes: an 8-byte header length, the JSON header, the data."""
        if file not in self.headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self.headers[file] = (8 + size, json.loads(f.read(size)))
        start, header = self.headers[file]
        entry = header[name]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{end - begin} bytes for shape {shape} of {dtype}")
        array = np.empty(shape, dtype)
        with open(file, "rb") as f:
            f.seek(start + begin)
            got = f.readinto(memoryview(array.reshape(-1).view(np.uint8)))
        if got != end - begin:
            raise ValueError(f"the file ends {end - begin - got} bytes early (truncated?)")
        return array


def load_safetensors_checkpoint(
    path: str | Path, dtype: jnp.dtype = jnp.float32, keep_blocks: bool = False, layers: range | None = None,
    mesh: Mesh | None = None, prepare_layer: PrepareLayer | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Read config and weights of an HF checkpoint directory of a supported architecture.

    A quantized checkpoint's layers come back as stored where that is exact (4-bit groups as
    GGUF-style blocks, 8-bit values with row scales as QuantArrays) with ``keep_blocks`` (a
    float32 model on one CPU device: load.py's ``keep_gguf_blocks``), else as the float32
    matrices the format defines, cast to ``dtype``. ``layers``: a pipeline stage's alone
    (``build_params``; the tensors of other layers are never read). ``mesh``, ``prepare_layer``:
    ``build_params``'s."""
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    quantization = read_quantization(path)
    names = _tensor_files(path)
    decoder_names = text_decoder_names(names) if any(n.startswith(_WRAPPED_PREFIXES) for n in names) else None
    if decoder_names is not None:
        names = {text: names[name] for text, name in decoder_names.items()}
    if quantization is None:
        stored = next((n for n in names if n.endswith(QUANTIZED_SUFFIXES)), None)
        if stored is not None:
            raise ModelLoadError(f"{path} holds quantized tensors ({stored!r}) but its config.json has no "
                                 "quantization_config saying how to read them")
    if config.tie_word_embeddings is False and not any(n.startswith("lm_head.") for n in names):
        # Some exports omit lm_head without saying the embeddings are tied.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    with contextlib.ExitStack() as stack:
        tensors = _Tensors(names, {file: stack.enter_context(_open(file)) for file in set(names.values())},
                           decoder_names)

        def get(name: str) -> Matrix | None:
            if quantization is not None and name.endswith(".weight"):
                matrix = quantization.matrix(name[: -len(".weight")], tensors, keep_blocks)
                if matrix is not None:
                    return matrix
            if quantization is not None:  # gpt-oss's MXFP4 experts (``*_blocks``), [E, out, in]
                experts = quantization.packed_experts(name, tensors, keep_blocks)
                if experts is not None:
                    return experts
            kind = tensors.dtype(name)
            if kind is not None and kind not in _FLOAT_DTYPES:
                how = "" if quantization is None else f" (its {quantization.method} layers store other tensors)"
                raise ModelLoadError(f"tensor {name!r} in {names[name]} is {kind}, not floats, and nothing in "
                                     f"config.json's quantization_config says how to read it{how}")
            array = tensors.read(name)
            if array is None:
                return None
            # A float32 model on one CPU device keeps 16-bit matrices as stored (build_params
            # widens what is not a matrix); otherwise everything is widened here.
            return array if keep_blocks and array.dtype in HALF_DTYPES else _to_float(array)

        family = HF_FAMILIES[config.architecture]
        if family.llama4:
            source = llama4_tensors(get, config)
        elif family.moe is not None and family.moe.gpt_oss_experts:  # read by model/loaders/hf_gpt_oss.py
            source = get
        else:
            source = fused_experts_tensors(get, config)
        params = build_params(config, source, str(path), dtype, norm_offset=1.0 if family.norm_plus_one else 0.0,
                              layers=layers, mesh=mesh, prepare_layer=prepare_layer)
    return config, params


def _to_float(array: np.ndarray) -> np.ndarray:
    """numpy cannot do arithmetic on ml_dtypes' bfloat16 everywhere; widen to float32."""
    return array if array.dtype == np.float32 else array.astype(np.float32)
