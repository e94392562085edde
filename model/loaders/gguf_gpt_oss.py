"""A llama.cpp ``gpt-oss`` file's experts answered under the names HF's gpt-oss loader asks for.

llama.cpp's converter splits HF's interleaved ``gate_up_proj`` (even rows gate, odd rows up)
into ``ffn_gate_exps`` and ``ffn_up_exps`` ``[E, I, D]`` (MXFP4 in the released files), their
biases into ``ffn_gate_exps.bias`` / ``ffn_up_exps.bias`` ``[E, I]``, and keeps ``down_proj``
as ``ffn_down_exps`` ``[E, D, I]``, outputs first. model/loaders/hf_gpt_oss.py reads the stacked
matrices outputs first under ``*_blocks`` (as HF's MXFP4 checkpoints store them) and the
biases interleaved, so the two halves are interleaved back here: a rearrangement of whole
rows, exact for blocks and floats alike.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from raylm.model.quantization.gguf_blocks import GgufBlocks, map_rows

_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_bias)?")
Tensor = np.ndarray | GgufBlocks
FileTensor = Callable[[str], "Tensor | None"]  # a GGUF tensor by its own name, None if absent


def _interleaved(gate: Tensor, up: Tensor) -> Tensor:
    """Rows of ``gate`` and ``up`` (``[E, I, ...]``) alternating, gate first: ``[E, 2I, ...]``."""
    return map_rows(lambda g, u: np.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1], *g.shape[2:]), gate, up)


def gpt_oss_experts(hf_name: str, tensor: FileTensor) -> Tensor | None | bool:
    """The answer for ``hf_name`` when it names a gpt-oss layer's experts (None: the file does
    not hold it in that form), or False when ``hf_name`` is not an expert tensor."""
    match = _EXPERTS_RE.fullmatch(hf_name)
    if match is None:
        return False
    layer, matrix, form = match.groups()
    prefix = f"blk.{layer}."
    if form is None:  # HF's float layout (inputs first): the file has the outputs-first one only
        return None
    kind = "weight" if form == "_blocks" else "bias"
    if matrix == "down_proj":
        return tensor(f"{prefix}ffn_down_exps.{kind}")
    gate, up = tensor(f"{prefix}ffn_gate_exps.{kind}"), tensor(f"{prefix}ffn_up_exps.{kind}")
    return None if gate is None or up is None else _interleaved(gate, up)
