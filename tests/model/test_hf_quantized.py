"""HF checkpoints stored quantized (AWQ, GPTQ, compressed-tensors, FP8) against independent references.

Each test quantizes a tiny random HF model's linear layers and writes them by hand the way the
format's tools do (int32 packing orders, zero-point conventions, scale layouts, as the formats
document them). The reference reads those written tensors back with plain numpy (unpack,
subtract the zero, multiply the scale), saves that as a float32 HF checkpoint and runs HF
transformers (torch) on it. raylm loading the quantized checkpoint must hold the reference's
float32 matrices bit for bit (expanded, or as blocks / 8-bit values with scales), give logits
within 1e-4 of HF's and the same greedy tokens.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.load import load_checkpoint, load_model
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.quant_array import QuantArray, weight_bytes
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # experts' too
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of an int32 holds column AWQ_ORDER[i] of its 8
FP8 = ml_dtypes.float8_e4m3fn
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2)  # inputs 128 / 256: groups of 128 fit
PROMPT = np.random.RandomState(3).randint(3, 320, size=21).tolist()


def _is_stored(leaf: Any) -> bool:
    return isinstance(leaf, (GgufBlocks, QuantArray))


def _leaves(params: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(params, is_leaf=_is_stored)


# ---- writing checkpoints the way the formats' tools do -------------------------------------


def _torch(array: np.ndarray) -> torch.Tensor:
    """numpy -> torch, 8-bit floats and bfloat16 included (torch knows them, numpy does not)."""
    if array.dtype == FP8:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _float_model(directory: Path, variant: str = "llama-gqa", **overrides: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny random checkpoint and its tensors as the file names them (an MoE's per expert)."""
    path, _ = build_tiny_checkpoint(variant, directory / "float", **{**SHAPE, **overrides})
    return path, load_file(str(path / "model.safetensors"))


def _write(directory: Path, source: Path, tensors: dict[str, np.ndarray], quantization: dict[str, Any] | None) -> Path:
    """``tensors`` as a checkpoint beside ``source``'s config (with ``quantization``) and tokenizer."""
    directory.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    save_file({k: _torch(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _pack(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Unsigned ``values`` packed ``32 // bits`` to an int32 along ``axis``, low bits first;
    field ``i`` of a word holds its value ``order[i]``."""
    per = 32 // bits
    order = order or list(range(per))
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = np.zeros(v.shape[:-1], np.uint32)
    for i in range(per):
        word |= v[..., order[i]] << np.uint32(bits * i)
    return np.moveaxis(word.view(np.int32), -1, axis)


def _unpack(words: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """The reference's reading of ``_pack``'s layout: value ``order[i]`` of a word is field ``i``."""
    per = 32 // bits
    order = order or list(range(per))
    w = np.moveaxis(words.view(np.uint32), axis, -1)
    out = np.zeros((*w.shape, per), np.int64)
    for i in range(per):
        out[..., order[i]] = (w >> np.uint32(bits * i)) & ((1 << bits) - 1)
    return np.moveaxis(out.reshape(*w.shape[:-1], -1), -1, axis)


def test_packing_orders_are_the_documented_ones():
    """Known answers: AutoAWQ's word for columns 0..7 holding 0..7 is 0x75316420; GPTQ and
    compressed-tensors put value j of a word in bits 4j (value 0 lowest)."""
    assert _pack(np.arange(8)[None], 4, 1, AWQ_ORDER).view(np.uint32)[0, 0] == 0x75316420
    assert _pack(np.arange(8)[None], 4, 1).view(np.uint32)[0, 0] == 0x76543210
    assert _pack(np.arange(4)[:, None] * 17, 8, 0).view(np.uint32)[0, 0] == 0x33221100
    values = np.random.default_rng(0).integers(0, 16, (4, 16))
    np.testing.assert_array_equal(_unpack(_pack(values, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), values)


def _minmax(w: np.ndarray, groups: np.ndarray, num_groups: int, maxq: int, sym: bool, scale_dtype: Any
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest quantization of ``w [out, in]`` per (row, group): unsigned ``q``, zero
    ``z`` and scale ``s [out, groups]`` (stored in ``scale_dtype``) with ``w ~ (q - z) * s``."""
    out = w.shape[0]
    lo, hi = np.zeros((out, num_groups), np.float32), np.zeros((out, num_groups), np.float32)
    for g in range(num_groups):
        lo[:, g], hi[:, g] = w[:, groups == g].min(1), w[:, groups == g].max(1)
    if sym:
        scale = (np.maximum(np.abs(lo), np.abs(hi)) / ((maxq + 1) / 2 - 0.5)).astype(scale_dtype)
        zero = np.full((out, num_groups), (maxq + 1) // 2)
    else:
        scale = ((hi - lo) / maxq).astype(scale_dtype)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, maxq).astype(np.int64)
    s = scale.astype(np.float32)[:, groups]
    q = np.clip(np.round(w / s + zero[:, groups]), 0, maxq).astype(np.int64)
    return q, zero, scale


def _dequantized(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The formats' formula, plainly: ``(q - z) * s``, in float32."""
    return (q - zero[:, groups]).astype(np.float32) * scale.astype(np.float32)[:, groups]


def _checkpoints(tmp_path: Path, state: dict[str, np.ndarray], source: Path,
                 quantize_layer, quantization: dict[str, Any], plain_dtype: Any = np.float16,
                 keep_float: tuple[str, ...] = ()) -> tuple[Path, Path, Any]:
    """The quantized checkpoint (``quantize_layer(name, w) -> (its tensors, reference w)`` for
    every linear layer not in ``keep_float``; other tensors in ``plain_dtype``), the float32
    reference checkpoint of what those tensors mean, and HF transformers' model (torch) of it."""
    tensors: dict[str, np.ndarray] = {}
    reference: dict[str, np.ndarray] = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and module not in keep_float:
            stored, reference[name] = quantize_layer(module, w)
            tensors.update({f"{module}.{k}": v for k, v in stored.items()})
        else:
            tensors[name] = w.astype(plain_dtype)
            reference[name] = tensors[name].astype(np.float32)
    quantized = _write(tmp_path / "quantized", source, tensors, quantization)
    reference_path = _write(tmp_path / "reference", source, reference, None)
    model = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32, attn_implementation="eager")
    return quantized, reference_path, model.eval()


def _assert_holds_reference(quantized: Path, reference: Path, dtype: str = "float32", keep: bool = True) -> Any:
    """raylm's matrices from ``quantized`` are the reference's float32 matrices, bit for bit."""
    _, params = load_checkpoint(quantized, dtype, keep_blocks=keep)
    _, expected = load_checkpoint(reference, dtype)
    got = _leaves(params)
    assert len(got) == len(_leaves(expected))
    for leaf, want in zip(got, _leaves(expected)):
        dense = leaf.dequantize() if _is_stored(leaf) else leaf
        if keep and dense.dtype in (jnp.bfloat16, jnp.float16) and want.dtype == jnp.float32:
            dense = dense.astype(jnp.float32)  # a 16-bit matrix kept as stored (hf_tensors.py), widened exactly
        assert dense.shape == want.shape and dense.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(dense), np.asarray(want))
    return params


def _assert_serves_like_hf(quantized: Path, model: Any) -> Any:
    """Logits within 1e-4 of HF's on the reference weights, and HF's greedy tokens."""
    config, params = load_checkpoint(quantized, keep_blocks=True)
    generator = SingleSequenceGenerator(config, params)
    with torch.no_grad():
        reference = model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(PROMPT), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(PROMPT, 8)) == hf_greedy(model, PROMPT, 8)
    return params


# ---- AWQ ----------------------------------------------------------------------------------


def _awq_layer(group: int):
    def quantize(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        out, size = w.shape
        groups = np.arange(size) // group
        q, zero, scale = _minmax(w, groups, size // group, 15, False, np.float16)
        stored = {"qweight": _pack(q.T, 4, 1, AWQ_ORDER), "qzeros": _pack(zero.T, 4, 1, AWQ_ORDER), "scales": scale.T}
        # The reference reads the written words back.
        ref = _dequantized(_unpack(stored["qweight"], 4, 1, AWQ_ORDER).T, _unpack(stored["qzeros"], 4, 1, AWQ_ORDER).T,
                           stored["scales"].T, groups)
        return stored, ref
    return quantize


def _awq_config(group: int, **extra: Any) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm", **extra}


def test_awq_serves_like_hf_on_its_dequantized_weights(tmp_path):
    source, state = _float_model(tmp_path)
    keep_float = ("model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj")
    quantized, reference, model = _checkpoints(tmp_path, state, source, _awq_layer(128),
                                               _awq_config(128, modules_to_not_convert=list(keep_float)),
                                               keep_float=keep_float)
    params = _assert_serves_like_hf(quantized, model)
    layer0, layer1 = params.layers
    assert all(isinstance(w, GgufBlocks) for w in (layer0.wqkv, layer0.wo, layer0.w_gate_up, layer0.w_down))
    assert isinstance(layer1.w_down, jax.Array)  # modules_to_not_convert: floats
    assert isinstance(layer1.wqkv, jax.Array)  # q, k blocks fused with a float v: expanded, exactly
    assert layer0.w_gate_up.nbytes < 0.2 * 4 * math.prod(layer0.w_gate_up.shape)  # 0.75 bytes a weight
    assert weight_bytes(params) < 0.7 * weight_bytes(load_checkpoint(reference)[1])
    _assert_holds_reference(quantized, reference)
    _assert_holds_reference(quantized, reference, keep=False)
    _assert_holds_reference(quantized, reference, "bfloat16", keep=False)


@pytest.mark.parametrize("group", [32, 64])
def test_awq_group_sizes(group, tmp_path):
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _awq_layer(group), _awq_config(group))
    params = _assert_holds_reference(quantized, reference)
    assert isinstance(params.layers[0].w_gate_up, GgufBlocks)


def test_awq_experts_serve_like_hf(tmp_path):
    """A mixture of experts (Qwen3-MoE: 8 experts of 32, a dense layer 1): every expert's
    matrices stacked as blocks, the router (not quantized by AutoAWQ) in floats."""
    source, state = _float_model(tmp_path, "qwen3-moe")
    quantized, reference, model = _checkpoints(tmp_path, state, source, _awq_layer(32), _awq_config(32))
    params = _assert_serves_like_hf(quantized, model)
    sparse = params.layers[0]
    assert isinstance(sparse.w_experts_gate_up, GgufBlocks) and sparse.w_experts_gate_up.shape == (8, 2, 32, 128)
    assert isinstance(sparse.w_experts_down, GgufBlocks) and isinstance(sparse.router, jax.Array)
    _assert_holds_reference(quantized, reference)


# ---- GPTQ ---------------------------------------------------------------------------------


def _gptq_layer(group: int, bits: int = 4, sym: bool = True, v1: bool = True, act_order: bool = False, seed: int = 0):
    maxq, per = (1 << bits) - 1, 32 // bits

    def quantize(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        out, size = w.shape
        if group == -1:
            groups = np.zeros(size, np.int64)
        elif act_order:  # inputs visited in a random order, each run of `group` of them one group
            groups = np.empty(size, np.int64)
            groups[np.random.default_rng(seed).permutation(size)] = np.arange(size) // group
        else:
            groups = np.arange(size) // group
        num_groups = int(groups.max()) + 1
        q, zero, scale = _minmax(w, groups, num_groups, maxq, sym, np.float16)
        stored_zero = (zero - 1) & maxq if v1 else zero  # v1 stores zeros minus one (z = 0 wraps to maxq)
        stored = {"qweight": _pack(q.T, bits, 0), "qzeros": _pack(stored_zero.T, bits, 1), "scales": scale.T,
                  "g_idx": groups.astype(np.int32)}
        read_zero = _unpack(stored["qzeros"], bits, 1).T + (1 if v1 else 0)  # w = s * (q - (z + 1)) in v1
        ref = _dequantized(_unpack(stored["qweight"], bits, 0).T, read_zero, stored["scales"].T, stored["g_idx"])
        assert stored["qweight"].shape == (size // per, out)
        return stored, ref
    return quantize


def _gptq_config(group: int, bits: int = 4, sym: bool = True, v1: bool = True, desc_act: bool = False) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01, "true_sequential": True,
            "static_groups": False, "model_name_or_path": None, "model_file_base_name": "model",
            "meta": {"quantizer": ["hand-written"]}}


def test_gptq_serves_like_hf_on_its_dequantized_weights(tmp_path):
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _gptq_layer(64, sym=False),
                                               _gptq_config(64, sym=False))
    params = _assert_serves_like_hf(quantized, model)
    assert isinstance(params.layers[0].wqkv, GgufBlocks) and isinstance(params.layers[1].w_down, GgufBlocks)
    _assert_holds_reference(quantized, reference)


@pytest.mark.parametrize("group,bits,sym,v1,act_order,blocks", [
    (32, 4, True, False, False, True),  # gptq_v2: zeros as they are
    (-1, 4, False, True, False, True),  # one group over all inputs
    (64, 4, False, True, True, False),  # act-order: a 32-input block spans groups -> float32
    (64, 8, True, True, False, True),  # symmetric 8-bit: signed bytes q - 128
    (64, 8, False, False, False, True),  # asymmetric 8-bit: signed bytes with offsets
])
def test_gptq_variants(group, bits, sym, v1, act_order, blocks, tmp_path):
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _gptq_layer(group, bits, sym, v1, act_order),
                                               _gptq_config(group, bits, sym, v1, desc_act=act_order))
    params = _assert_holds_reference(quantized, reference)
    assert any(_is_stored(leaf) for leaf in _leaves(params)) == blocks
    assert isinstance(params.layers[0].w_down, GgufBlocks) == blocks
    if bits == 8 and not sym:  # bytes with offsets through the kernels too
        assert params.layers[0].w_down.offset.shape == (128, 8)
        _assert_serves_like_hf(quantized, model)


# ---- compressed-tensors -------------------------------------------------------------------


def _ct_packed_layer(group: int, sym: bool, scale_dtype: Any = ml_dtypes.bfloat16):
    def quantize(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        out, size = w.shape
        groups = np.arange(size) // group
        q, zero, scale = _minmax(w, groups, size // group, 15, sym, scale_dtype)
        # compressed-tensors quantizes to signed int4 and packs q + 8 (and zero points + 8) unsigned.
        stored = {"weight_packed": _pack(q, 4, 1), "weight_scale": scale,
                  "weight_shape": np.array([out, size], np.int64)}
        if not sym:
            stored["weight_zero_point"] = _pack(zero, 4, 0)
        signed_q = _unpack(stored["weight_packed"], 4, 1) - 8
        signed_zero = _unpack(stored["weight_zero_point"], 4, 0) - 8 if not sym else np.zeros_like(zero)
        return stored, _dequantized(signed_q, signed_zero, scale, groups)
    return quantize


def _ct_config(groups: dict[str, Any], fmt: str | None, **extra: Any) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "global_compression_ratio": 1.9, "version": "0.10.0", **extra}


def _w4a16(group: int, sym: bool) -> dict[str, Any]:
    return {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                        "weights": {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                                    "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax",
                                    "observer_kwargs": {}}}}


def test_compressed_tensors_w4a16_serves_like_hf(tmp_path):
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _ct_packed_layer(32, sym=False),
                                               _ct_config(_w4a16(32, False), "pack-quantized"), ml_dtypes.bfloat16)
    params = _assert_serves_like_hf(quantized, model)
    assert isinstance(params.layers[0].wqkv, GgufBlocks)
    _assert_holds_reference(quantized, reference)


@pytest.mark.parametrize("group,sym,scale_dtype,blocks", [
    (128, True, ml_dtypes.bfloat16, True),
    (64, True, np.float16, True),
    (32, True, np.float32, True),  # float32 scales, symmetric: bytes q - 8, one product as the formula
    (32, False, np.float32, False),  # float32 scales, zero points: s * q would round -> float32 matrices
])
def test_compressed_tensors_w4a16_variants(group, sym, scale_dtype, blocks, tmp_path):
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _ct_packed_layer(group, sym, scale_dtype),
                                               _ct_config(_w4a16(group, sym), "pack-quantized"), ml_dtypes.bfloat16)
    params = _assert_holds_reference(quantized, reference)
    w_down = params.layers[0].w_down
    assert isinstance(w_down, GgufBlocks) == blocks
    if blocks:
        assert w_down.nibbles == (scale_dtype != np.float32)


def _ct_8bit_layer(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Attention: int8 per output channel (W8A8); MLP: fp8 per channel (gate/up) or per tensor (down)."""
    absmax = np.abs(w).max(axis=1, keepdims=True)
    if "self_attn" in module:
        scale = (absmax / 127).astype(ml_dtypes.bfloat16)
        q = np.clip(np.round(w / scale.astype(np.float32)), -128, 127).astype(np.int8)
        stored = {"weight": q, "weight_scale": scale, "input_scale": np.ones(1, np.float32)}  # activation-side
    else:
        scale = (absmax / 448).astype(np.float32) if "down" not in module else np.array([absmax.max() / 448],
                                                                                         np.float32)
        q = (w / scale.reshape(-1, 1)).astype(FP8)
        stored = {"weight": q, "weight_scale": scale}
    return stored, q.astype(np.float32) * stored["weight_scale"].astype(np.float32).reshape(-1, 1)


W8A8_GROUPS = {
    "attention": {"targets": ["re:.*self_attn\\..*_proj$"], "format": "int-quantized",
                  "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                              "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                        "dynamic": True}},
    "mlp_channel": {"targets": ["re:.*mlp\\.(gate|up)_proj$"], "format": "float-quantized",
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
    "mlp_tensor": {"targets": ["re:.*mlp\\.down_proj$"], "format": "float-quantized",
                   "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}},
}


def test_compressed_tensors_int8_and_fp8_serve_like_hf(tmp_path):
    """A mixed-precision export: W8A8 int8 attention, FP8 MLP (per channel and per tensor), the
    activations' quantization not reproduced (raylm computes with float activations)."""
    source, state = _float_model(tmp_path)
    quantized, reference, model = _checkpoints(tmp_path, state, source, _ct_8bit_layer,
                                               _ct_config(W8A8_GROUPS, "mixed-precision"), ml_dtypes.bfloat16)
    params = _assert_serves_like_hf(quantized, model)
    layer = params.layers[0]
    assert isinstance(layer.wqkv, QuantArray) and layer.wqkv.q.dtype == np.int8 and layer.wqkv.scale.shape == (2, 4, 32)
    assert isinstance(layer.w_gate_up, QuantArray) and layer.w_gate_up.q.dtype == FP8
    assert isinstance(layer.w_down, QuantArray) and len(set(np.asarray(layer.w_down.scale).tolist())) == 1
    _assert_holds_reference(quantized, reference)
    _assert_holds_reference(quantized, reference, keep=False)


# ---- FP8 (HF FineGrainedFP8 / AutoFP8) ----------------------------------------------------


def _fp8_block_layer(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    out, size = w.shape
    rows, cols = math.ceil(out / 128), math.ceil(size / 128)
    padded = np.zeros((rows * 128, cols * 128), np.float32)
    padded[:out, :size] = np.abs(w)
    scale = (padded.reshape(rows, 128, cols, 128).max(axis=(1, 3)) / 448).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:out, :size]
    q = (w / full).astype(FP8)
    return {"weight": q, "weight_scale_inv": scale}, q.astype(np.float32) * full


def test_fp8_block_scaled_serves_like_hf(tmp_path):
    """128x128 blocks, partial ones included: k/v have 64 rows, down_proj 192 inputs."""
    source, state = _float_model(tmp_path, intermediate_size=192)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    quantized, reference, model = _checkpoints(tmp_path, state, source, _fp8_block_layer, config, ml_dtypes.bfloat16)
    params = _assert_serves_like_hf(quantized, model)
    _assert_holds_reference(quantized, reference)
    layer = params.layers[0]
    for matrix in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):  # kept as fp8, a scale per 32 inputs
        assert isinstance(matrix, GgufBlocks) and matrix.fp8 and matrix.nbytes < 1.2 * math.prod(matrix.shape)


def test_fp8_per_tensor_and_per_channel_are_quant_arrays(tmp_path):
    """AutoFP8's layout: weight_scale per tensor ([] here) or per output row; input_scale ignored."""
    source, state = _float_model(tmp_path)

    def quantize(module: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        per_tensor = "self_attn" in module
        scale = np.array(np.abs(w).max() / 448, np.float32) if per_tensor else \
            (np.abs(w).max(axis=1, keepdims=True) / 448).astype(np.float32)
        q = (w / scale.reshape(-1, 1) if not per_tensor else w / scale).astype(FP8)
        stored = {"weight": q, "weight_scale": scale, "input_scale": np.array(1.0, np.float32)}
        return stored, q.astype(np.float32) * (scale if per_tensor else scale.reshape(-1, 1))

    config = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    quantized, reference, model = _checkpoints(tmp_path, state, source, quantize, config, ml_dtypes.bfloat16)
    params = _assert_holds_reference(quantized, reference)
    assert isinstance(params.layers[0].wqkv, QuantArray) and isinstance(params.layers[0].w_gate_up, QuantArray)
    assert params.layers[0].wqkv.q.dtype == FP8


def test_engine_serves_a_gptq_checkpoint_from_blocks(tmp_path):
    """The serving path: ``LLM`` on the directory (gguf_blocks auto: kept as stored on one CPU
    device), a batch of two prompts, HF's greedy tokens for each."""
    source, state = _float_model(tmp_path)
    quantized, _, model = _checkpoints(tmp_path, state, source, _gptq_layer(128), _gptq_config(128))
    llm = LLM(str(quantized), max_model_len=64, num_kv_blocks=16, max_num_seqs=2)
    assert isinstance(llm.engine.model.params.layers[0].w_gate_up, GgufBlocks)
    prompts = [PROMPT, PROMPT[:9]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 6) for p in prompts]


def test_a_stored_quantized_checkpoint_is_not_quantized_again(tmp_path):
    source, state = _float_model(tmp_path)
    quantized, _, model = _checkpoints(tmp_path, state, source, _awq_layer(128), _awq_config(128))
    with pytest.raises(ValueError, match="awq checkpoint, stored quantized.*cannot be quantized again as int8"):
        load_model(quantized, quantization="int8")
    loaded = load_model(quantized, keep_blocks=True)
    assert loaded.checkpoint_quantization == "awq" and loaded.quantized("none") is loaded
    with pytest.raises(ValueError, match="cannot be quantized again as fp8"):
        loaded.quantized("fp8")


# ---- bad files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_tensors(tmp_path_factory):
    """A small AWQ checkpoint's tensors and its source directory, to break in the tests below."""
    tmp = tmp_path_factory.mktemp("awq")
    source, state = _float_model(tmp)
    quantized, _, _ = _checkpoints(tmp, state, source, _awq_layer(32), _awq_config(32))
    return load_file(str(quantized / "model.safetensors")), source


Q_PROJ = "model.layers.0.self_attn.q_proj"


def _broken(tmp_path, awq_tensors, config: dict[str, Any], change=None) -> Path:
    tensors, source = awq_tensors
    tensors = dict(tensors)
    if change is not None:
        change(tensors)
    return _write(tmp_path / "broken", source, tensors, config)


@pytest.mark.parametrize("config,change,message", [
    (_awq_config(32), lambda t: t.pop(f"{Q_PROJ}.scales"),
     rf"tensor '{Q_PROJ}.scales' \(awq checkpoint\) is missing"),
    (_awq_config(48), None,  # o_proj: the first matrix of a layer to load
     r"tensor 'model.layers.0.self_attn.o_proj.qweight' .* 128 inputs are not whole groups of 48"),
    (_awq_config(32), lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"][:96]}),
     rf"tensor '{Q_PROJ}.qweight' .* has shape \(96, 16\), expected \(128, 16\)"),
    (_awq_config(32), lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"][:, :15]}),
     rf"tensor '{Q_PROJ}.qweight' .* has shape \(128, 15\), expected \(128, 16\)"),
    (_awq_config(32), lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"].astype(np.float32)}),
     rf"tensor '{Q_PROJ}.qweight' .* is F32, expected I32"),
    (_awq_config(32) | {"bits": 3}, None, r"quantization_config \(awq\): bits 3 is not supported"),
    (_awq_config(32) | {"version": "gemv"}, None, r"version/format 'gemv' is not supported"),
    (_awq_config(32) | {"quant_method": "bitsandbytes"}, None, r"quant_method 'bitsandbytes' is not supported"),
    (_gptq_config(32) | {"bits": 3}, None, r"quantization_config \(gptq\): bits 3 is not supported"),
    (_gptq_config(32) | {"checkpoint_format": "marlin"}, None, r"checkpoint_format/format 'marlin' is not supported"),
    (_gptq_config(32) | {"dynamic": {"-:.*down": {}}}, None, r"\(gptq\): dynamic \(not implemented by raylm"),
    (_awq_config(32) | {"zero_point": False}, None, r"zero_point false is not supported"),
    (_ct_config(_w4a16(32, True), "sparse-24-bitmask"), None, r"format 'sparse-24-bitmask' of config_groups"),
    (_ct_config(_w4a16(32, True), "pack-quantized", transform_config={"x": 1}), None, r"transform_config"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, None, r"scale_fmt 'ue8m0' is not supported"),
    (None, None, r"holds quantized tensors .* no quantization_config"),
])
def test_bad_quantized_checkpoints_name_the_problem(config, change, message, awq_tensors, tmp_path):
    path = _broken(tmp_path, awq_tensors, config, change)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path, keep_blocks=True)


def test_fp8_and_compressed_tensors_errors_name_the_tensor(tmp_path):
    source, state = _float_model(tmp_path, num_hidden_layers=1)
    tensors = {k: v for k, v in state.items()}
    tensors[f"{Q_PROJ}.weight"] = state[f"{Q_PROJ}.weight"].astype(FP8)
    fp8 = _write(tmp_path / "fp8", source, tensors, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match=rf"tensor '{Q_PROJ}.weight_scale_inv' \(fp8 checkpoint\) is missing"):
        load_checkpoint(fp8)
    tensors[f"{Q_PROJ}.weight_scale_inv"] = np.ones((2, 2), np.float32)
    fp8 = _write(tmp_path / "fp8-shape", source, tensors, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv' .* has shape \(2, 2\), expected \(1, 1\)"):
        load_checkpoint(fp8)
    packed, _ = _ct_packed_layer(32, True)(Q_PROJ, state[f"{Q_PROJ}.weight"])
    tensors = {k: v for k, v in state.items() if k != f"{Q_PROJ}.weight"}
    tensors.update({f"{Q_PROJ}.{k}": v for k, v in packed.items()})
    ct = _write(tmp_path / "ct", source, tensors, _ct_config(_w4a16(48, True), "pack-quantized"))
    with pytest.raises(ModelLoadError, match=rf"'{Q_PROJ}.weight_packed' .* 128 inputs, which group_size 48 does not"):
        load_checkpoint(ct)
    ct = _write(tmp_path / "ct-ignored", source, tensors,
                _ct_config(_w4a16(32, True), "pack-quantized", ignore=["lm_head", Q_PROJ]))
    with pytest.raises(ModelLoadError, match=rf"no config_groups entry targets {Q_PROJ}"):
        load_checkpoint(ct)
