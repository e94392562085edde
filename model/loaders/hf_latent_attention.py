"""DeepSeek's latent-attention tensors (HF names) -> ``LayerParams`` fields
(model/decoder/params.py): each per-head matrix viewed ``[heads, rows per head, inputs]``."""

from __future__ import annotations

from typing import Callable

import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.quantization.gguf_blocks import GgufBlocks, dequantized
from raylm.model.quantization.quant_array import QuantArray

HostMatrix = np.ndarray | GgufBlocks | QuantArray
# (HF tensor name, expected shape) -> the tensor (the loader raises if it is missing or misshapen).
Fetch = Callable[[str, tuple[int, ...]], HostMatrix]


def latent_attention_tensors(fetch: Fetch, config: ModelConfig, layer: int) -> dict[str, HostMatrix]:
    """Layer ``layer``'s MLA fields (all but ``wo``, shared with GQA) from ``fetch``."""
    mla, H, D = config.mla, config.num_heads, config.hidden_size
    prefix = f"model.layers.{layer}.self_attn."

    def matrix(name: str, rows: int, inputs: int) -> HostMatrix:
        return _as_float(fetch(prefix + name + ".weight", (rows, inputs)))

    def per_head(name: str, rows_per_head: int, inputs: int) -> HostMatrix:
        return matrix(name, H * rows_per_head, inputs).reshape(H, rows_per_head, inputs)

    fields = {
        "wkv_a": matrix("kv_a_proj_with_mqa", mla.latent_dim, D),
        "kv_a_norm": _as_float(fetch(prefix + "kv_a_layernorm.weight", (mla.kv_lora_rank,))),
        "wkv_b": per_head("kv_b_proj", mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank),
    }
    if mla.q_lora_rank is None:
        fields["wq"] = per_head("q_proj", mla.qk_head_dim, D)
    else:
        fields.update(
            wq_a=matrix("q_a_proj", mla.q_lora_rank, D),
            q_a_norm=_as_float(fetch(prefix + "q_a_layernorm.weight", (mla.q_lora_rank,))),
            wq_b=per_head("q_b_proj", mla.qk_head_dim, mla.q_lora_rank),
        )
    return fields


def _as_float(array: HostMatrix) -> np.ndarray:
    """As float32 (the model dtype is cast on placing them): the absorbed form contracts
    ``kv_b_proj`` per head rather than through the dense kernels, so these are not kept as stored
    (a GGUF file's blocks and 8-bit values expanded exactly)."""
    if isinstance(array, QuantArray):
        return np.asarray(array.dequantize(), np.float32)
    return dequantized(array).astype(np.float32, copy=False)
