"""A parsed llama.cpp GGUF file: metadata, config, and tensors read on demand.

Reading metadata needs no JAX (the router reads a GGUF's config and tokenizer, never its
weights); ``model/loaders/gguf_checkpoint.py`` turns the tensors into ``ModelParams``.
"""

from __future__ import annotations

import dataclasses
import mmap
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import ml_dtypes
import numpy as np
from gguf.quants import dequantize

from raylm.model.config.deepseek_routing import OPTIONAL_SCORE_BIAS
from raylm.model.config.families import GGUF_FAMILIES, HF_FAMILIES
from raylm.model.config.gguf_metadata import ROPE_TENSORS
from raylm.model.config.model_config import ModelConfig
from raylm.model.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from raylm.model.quantization.gguf_blocks import GgufBlocks

# 16-bit float tensor types and the numpy dtypes they are read as, kept with ``keep_blocks``.
_HALF_TYPES = {
    gguf.GGMLQuantizationType.F16: np.dtype(np.float16),
    gguf.GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
}


class GGUFReader(gguf.GGUFReader):
    """gguf's reader, parsing from a plain ``ndarray`` view of the file's memory map.

    gguf's ``GGUFReader`` slices its ``np.memmap`` once or twice per value as it parses the
    metadata, and each memmap slice runs numpy's Python-level ``__getitem__`` and
    ``__array_finalize__``: the bundled model's tokenizer is ~98,000 strings, which took 3-5 s of
    every replica's, router's and ``raylm generate``'s start on a 2-core EPYC. The same bytes
    through a plain view of the same map (no copy; tensors stay views of the file) parse in a
    third to a quarter of that time, to the same fields and tensors."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is not np.ndarray:  # the map GGUFReader.__init__ just made: view it once
            self.file_map: mmap.mmap | None = getattr(self.data, "_mmap", None)
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def release(self, tensor: gguf.ReaderTensor) -> None:
        """Unmaps ``tensor``'s pages from this process (they stay in the page cache; a later read
        faults them in again). Why: a tensor the loader copied out of the file (transcoded
        blocks, dequantized floats) is not read from the map again, but its touched pages stayed
        mapped, counted in the process's RSS, until the map was freed: a gpt-oss-shaped file's load
        peaked at its packed weights plus the whole file (9.1 GiB for 4.2 of weights)."""
        file_map = getattr(self, "file_map", None)
        if file_map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        length = tensor.data_offset + tensor.n_bytes - start
        if length > 0:
            file_map.madvise(mmap.MADV_DONTNEED, start, min(length, len(file_map) - start))


class GGUFFile:
    """A parsed GGUF file: decoded metadata fields and lazily dequantized tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {self.path} not found")
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as err:  # gguf raises ValueError/struct.error/IndexError on junk
            raise ModelLoadError(f"cannot read {self.path} as GGUF: {err}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.read: set[str] = set()  # names of the tensors asked for (see load_gguf_checkpoint)

    @cached_property
    def fields(self) -> dict[str, Any]:
        """Metadata as plain Python values (strings, numbers, lists)."""
        return {name: field.contents() for name, field in self._reader.fields.items()}

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def tensor(self, name: str, keep_blocks: bool = False) -> np.ndarray | GgufBlocks | None:
        """The tensor in numpy (= HF ``[out, in]``) layout, or None if absent: dequantized to
        float32, or with ``keep_blocks`` a block-quantized matrix (the types in
        ``GGUF_BLOCK_TYPES``; or an MoE layer's stacked experts ``[E, out, in]``) as ``GgufBlocks``
        and an F16 or BF16 matrix as float16 or bfloat16."""
        info = self._tensors.get(name)
        if info is None:
            return None
        self.read.add(name)
        shape = tuple(int(d) for d in reversed(info.shape))
        if keep_blocks and info.tensor_type in _HALF_TYPES and len(shape) in (2, 3):
            # 16-bit float matrices as stored (a float32 model keeps them: hf_tensors.py).
            return np.asarray(info.data).view(_HALF_TYPES[info.tensor_type]).reshape(shape)
        if keep_blocks:
            from raylm.model.quantization.gguf_blocks import GGUF_BLOCK_TYPES, from_gguf

            if info.tensor_type in GGUF_BLOCK_TYPES and len(shape) in (2, 3):
                try:
                    blocks = from_gguf(info.data, info.tensor_type, shape, name)  # type: ignore[arg-type]
                except ValueError as err:
                    raise ModelLoadError(f"{self.path}: {err}") from None
                self._reader.release(info)  # (copied: its arrays are no views of the file)
                return blocks
        try:
            array = dequantize(info.data, info.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} uses GGML type {info.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        result = np.asarray(array, dtype=np.float32).reshape(shape)
        if not np.may_share_memory(result, info.data):  # (an F32 tensor is a view of the file)
            self._reader.release(info)
        return result

    def config(self) -> ModelConfig:
        """ModelConfig from metadata and RoPE factor tensors; embeddings are tied when the file
        has no output matrix; where llama.cpp takes q/k/v biases and q/k norms when the file has
        them (GLM-4.5), so does this."""
        rope_tensors = {name: self.tensor(name).ravel().tolist() for name in ROPE_TENSORS if name in self._tensors}
        config = ModelConfig.from_gguf_fields(self.fields, str(self.path), rope_tensors)
        config = dataclasses.replace(config, tie_word_embeddings="output.weight" not in self._tensors)
        family = HF_FAMILIES[GGUF_FAMILIES[config.architecture]]
        if family.reads_attention_bias:  # optional tensors in llama.cpp (GLM-4.5): there or not
            config = dataclasses.replace(config, attention_bias="blk.0.attn_q.bias" in self._tensors)
        if family.qk_norm_key is not None:
            config = dataclasses.replace(config, qk_norm="blk.0.attn_q_norm.weight" in self._tensors)
        moe = config.moe
        if moe is not None and moe.deepseek is not None and config.architecture in OPTIONAL_SCORE_BIAS:
            # (DeepSeek V3's files hold the routers' correction bias, V2's do not: llama.cpp adds it if there.)
            biased = f"blk.{config.moe_layers[0]}.exp_probs_b.bias" in self._tensors
            routing = dataclasses.replace(moe.deepseek, score_correction=biased)
            config = dataclasses.replace(config, moe=dataclasses.replace(moe, deepseek=routing))
        return config
