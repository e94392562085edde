"""A llama.cpp ``gpt-oss`` file's experts answered under the names HF's gpt-oss loader asks for.

llama.cpp's converter splits HF's interleaved ``gate_up_proj`` (even rows gate, odd rows up)
into ``ffn_gate_exps`` and ``ffn_up_exps`` ``[E, I, D]`` (MXFP4 in the released files), their
biases into ``ffn_gate_exps.bias`` / ``ffn_up_exps.bias`` ``[E, I]``, and keeps ``down_proj``
as ``ffn_down_exps`` ``[E, D, I]``, outputs first. model/loaders/hf_gpt_oss.py reads the stacked
matrices outputs first under ``*_blocks`` (as HF's MXFP4 checkpoints store them), and asks first
for the two halves apart (``experts.gate_proj_blocks`` / ``up_proj_blocks``, ``*_bias``), which
only these files answer: the decoder holds gate and up apart too, so interleaving them here for
the HF loader to split again cost two copies of two thirds of the experts' bytes at load.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from raylm.model.quantization.gguf_blocks import GgufBlocks

_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(_blocks|_bias)?")
_FILE_MATRIX = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
Tensor = np.ndarray | GgufBlocks
FileTensor = Callable[[str], "Tensor | None"]  # a GGUF tensor by its own name, None if absent


def gpt_oss_experts(hf_name: str, tensor: FileTensor) -> Tensor | None | bool:
    """The answer for ``hf_name`` when it names a gpt-oss layer's experts (None: the file does
    not hold it in that form), or False when ``hf_name`` is not an expert tensor."""
    match = _EXPERTS_RE.fullmatch(hf_name)
    if match is None:
        return False
    layer, matrix, form = match.groups()
    if form is None or matrix == "gate_up_proj":  # HF's float or interleaved layouts: the file holds neither
        return None
    return tensor(f"blk.{layer}.{_FILE_MATRIX[matrix]}.{'weight' if form == '_blocks' else 'bias'}")
