"""Turn a checkpoint's per-layer HF-named tensors into the ``ModelParams`` pytree.

Every format loader (safetensors, GGUF) only has to answer "give me the tensor HF calls
``name``, as a float numpy array in HF's ``[out, in]`` layout" (or, for a matrix kept as
stored, a ``GgufBlocks`` or ``QuantArray`` of that shape); naming, orientation, fusing (QKV
grouped by KV head, gate/up), shape checks and the dtype cast live here once.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.params import LayerParams, ModelParams, shape_mismatches, stage_ends
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.hf_gpt_oss import gpt_oss_moe_fields
from raylm.model.loaders.hf_latent_attention import latent_attention_tensors
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.gguf_blocks import dequantized as blocks_dequantized
from raylm.model.quantization.gguf_blocks import map_rows as blocks_map_rows
from raylm.model.quantization.quant_array import QuantArray
from raylm.model.runtime.sharding import ParamPlacer

if TYPE_CHECKING:
    from jax.sharding import Mesh

# What a layer becomes as soon as it is built (``build_params``): the integer mode's packing.
PrepareLayer = Callable[[LayerParams], LayerParams]

# 16-bit float matrices a float32 model keeps as stored (the loaders return them only with
# ``keep_blocks``); build_params widens everything else (norms, biases, routers, MoE experts).
HALF_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# The fields read through the dense kernels, which take 16-bit matrices (model/kernels/dense.py).
_HALF_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "shared_gate_proj", "shared_up", "shared_down")

# Kept float32 whatever the model dtype (HF's _keep_in_fp32_modules_strict).
_FLOAT32_FIELDS = ("router_score_bias",)

# Answers an HF tensor name with its array, or None if the checkpoint lacks it.
TensorSource = Callable[[str], "np.ndarray | GgufBlocks | QuantArray | None"]

_PREFIX = "model.layers.{i}."
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    # A sparse layer (model/decoder/moe.py): the router (its experts: ``stacked_experts``), and
    # Qwen2-MoE's shared expert with its gate.
    "router": "mlp.gate.weight",
    "shared_gate_proj": "mlp.shared_expert.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    "shared_gate": "mlp.shared_expert_gate.weight",
    # DeepSeek V3 / GLM-4.5's score-correction bias (their shared experts: ``deepseek_shared_experts``).
    "router_score_bias": "mlp.gate.e_score_correction_bias",
    # gpt-oss (its experts and router: model/loaders/hf_gpt_oss.py).
    "bo": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
}
# How HF checkpoints name each expert's matrices: Qwen-MoE / OLMoE, and Mixtral (w1 gate, w3
# up, w2 down, under "block_sparse_moe", its router too). GGUF files hold them stacked, under
# the names "mlp.experts.gate_proj" etc. here (gguf_loader's table).
_EXPERT_NAMINGS = (
    ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
)
# Sandwich-norm models (Gemma) name their norms after their place: "post_attention" follows
# attention, and the norm before the MLP is "pre_feedforward" (Llama's "post_attention").
_SANDWICH_NAMES = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")
# Checkpoints that store Q/K/V as one matrix and gate/up as another (Phi-3): HF name of the
# fused tensor -> the parts it stacks along its rows, in order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def map_rows(fn: Callable[..., np.ndarray],
             *matrices: np.ndarray | GgufBlocks | QuantArray) -> np.ndarray | GgufBlocks | QuantArray:
    """``fn`` (which rearranges leading, output dims only) over host matrices: gguf_blocks'
    ``map_rows`` for floats and blocks; on the values and the row scales of QuantArrays of one
    storage type; a mix with QuantArrays is expanded to float32 first (exact, just larger)."""
    if not any(isinstance(m, QuantArray) for m in matrices):
        floats = [m for m in matrices if isinstance(m, np.ndarray)]
        if len({m.dtype for m in floats}) > 1:  # 16-bit matrices of mixed kinds: widened (exact)
            matrices = tuple(m.astype(np.float32) if isinstance(m, np.ndarray) else m for m in matrices)
        return blocks_map_rows(fn, *matrices)
    first = matrices[0]
    if all(isinstance(m, QuantArray) and m.q.dtype == first.q.dtype for m in matrices):
        return QuantArray(fn(*(m.q for m in matrices)), fn(*(m.scale for m in matrices)))
    return fn(*(dequantized(m) for m in matrices))


def dequantized(matrix: np.ndarray | GgufBlocks | QuantArray) -> np.ndarray:
    """A host matrix as a float32 numpy array (blocks and 8-bit values expanded exactly)."""
    if isinstance(matrix, QuantArray):
        return np.asarray(matrix.dequantize(), np.float32)
    return blocks_dequantized(matrix)


def _with_input_shape(matrix: np.ndarray | GgufBlocks | QuantArray,
                      input_shape: tuple[int, ...]) -> np.ndarray | GgufBlocks | QuantArray:
    """A host ``[N, K]`` matrix with its inputs viewed as ``input_shape``."""
    if isinstance(matrix, GgufBlocks):
        return matrix.with_input_shape(input_shape)
    if isinstance(matrix, QuantArray):
        return QuantArray(matrix.q.reshape(*matrix.scale.shape, *input_shape), matrix.scale)
    return matrix.reshape(*matrix.shape[:-1], *input_shape)


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """``[H*Dh, ...]``, ``[KVH*Dh, ...]`` x2 (HF's output dim first) -> ``[KVH, G+2, Dh, ...]``.

    Grouped by KV head (its G query heads, its key, its value) so a tensor-parallel split of
    the KV-head axis keeps each query head with the keys it reads. Only the leading dim is
    rearranged, so the same call fuses weights, biases and GGUF blocks' arrays.
    """
    rest = q.shape[1:]
    Dh = k.shape[0] // num_kv_heads
    groups = q.shape[0] // k.shape[0]  # explicit, not -1: Q8_0 blocks' offsets are [rows, 0]
    return np.concatenate(
        [
            q.reshape(num_kv_heads, groups, Dh, *rest),
            k.reshape(num_kv_heads, 1, Dh, *rest),
            v.reshape(num_kv_heads, 1, Dh, *rest),
        ],
        axis=1,
    )


def _hf_shape(field: str, config: ModelConfig) -> tuple[int, ...]:
    """Shape HF stores for one layer's tensor (to report mismatches in the file's own terms)."""
    H, KVH, Dh, D, I = (
        config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size, config.intermediate_size,
    )
    if config.moe is not None and field.startswith(("router", "shared")):
        E, Is = config.moe.num_experts, config.moe.shared_expert_size
        return {
            "router": (E, D), "shared_gate_proj": (Is, D), "shared_up": (Is, D), "shared_down": (D, Is),
            "shared_gate": (1, D), "router_score_bias": (E,),
        }[field]
    return {
        "attn_norm": (D,), "mlp_norm": (D,),
        "wq": (H * Dh, D), "wk": (KVH * Dh, D), "wv": (KVH * Dh, D), "wo": (D, H * config.attn_out_dim),
        "w_gate": (I, D), "w_up": (I, D), "w_down": (D, I),
        "bq": (H * Dh,), "bk": (KVH * Dh,), "bv": (KVH * Dh,),
        "q_norm": (H * Dh if config.qk_norm_whole else Dh,), "k_norm": (KVH * Dh if config.qk_norm_whole else Dh,),
        "post_attn_norm": (D,), "post_mlp_norm": (D,), "bo": (D,), "sinks": (H,),
    }[field]


def unfused(get: TensorSource, config: ModelConfig) -> TensorSource:
    """``get`` that also answers a part (q/k/v, gate/up) of a fused checkpoint tensor by
    slicing its rows (blocks stay blocks: their rows are whole)."""
    H, KVH, Dh, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    rows = {"self_attn.qkv_proj.weight": (H * Dh, KVH * Dh, KVH * Dh), "mlp.gate_up_proj.weight": (I, I)}

    def answer(name: str) -> np.ndarray | GgufBlocks | QuantArray | None:
        found = get(name)
        if found is not None:
            return found
        match = _LAYER_RE.fullmatch(name)
        if match is None:
            return None
        for fused, parts in _FUSED.items():
            if match.group(2) in parts:
                whole = get(f"model.layers.{match.group(1)}.{fused}")
                if whole is None:
                    return None
                sizes = rows[fused]
                if whole.shape[0] != sum(sizes):
                    raise ModelLoadError(f"tensor {fused!r} of layer {match.group(1)} has {whole.shape[0]} rows, "
                                         f"expected {sum(sizes)}")
                start = sum(sizes[: parts.index(match.group(2))])
                stop = start + sizes[parts.index(match.group(2))]
                return map_rows(lambda a: a[start:stop], whole)
        return None

    return answer


def mixtral_router(get: TensorSource) -> TensorSource:
    """``get`` that also answers a layer's router (``mlp.gate.weight``) under Mixtral's name."""

    def answer(name: str) -> np.ndarray | GgufBlocks | QuantArray | None:
        found = get(name)
        if found is not None:
            return found
        match = _LAYER_RE.fullmatch(name)
        if match is None or match.group(2) != "mlp.gate.weight":
            return None
        return get(f"model.layers.{match.group(1)}.block_sparse_moe.gate.weight")

    return answer


def deepseek_shared_experts(get: TensorSource) -> TensorSource:
    """``get`` that also answers a layer's shared expert (``mlp.shared_expert.*``) under
    DeepSeek's and GLM-4.5's name (``mlp.shared_experts.*``)."""

    def answer(name: str) -> np.ndarray | GgufBlocks | QuantArray | None:
        found = get(name)
        if found is not None:
            return found
        match = _LAYER_RE.fullmatch(name)
        if match is None or not match.group(2).startswith("mlp.shared_expert."):
            return None
        return get(f"model.layers.{match.group(1)}.mlp.shared_experts.{match.group(2)[len('mlp.shared_expert.'):]}")

    return answer


def stacked_experts(get: TensorSource, config: ModelConfig, layer: int, projs: tuple[str, ...],
                    source: str) -> np.ndarray | GgufBlocks | QuantArray:
    """Layer ``layer``'s experts' ``projs`` matrices (of gate_proj, up_proj, down_proj) as one
    array ``[E, len(projs), out, in]`` (``[E, out, in]`` for one), copied once: from the
    stacked tensors a GGUF file holds (blocks stay blocks), or from an HF checkpoint's tensor
    per expert."""
    E, Ie, D = config.moe.num_experts, config.moe.expert_size, config.hidden_size
    shapes = {"gate_proj": (Ie, D), "up_proj": (Ie, D), "down_proj": (D, Ie)}
    stacked = [get(f"model.layers.{layer}.mlp.experts.{p}") for p in projs]
    if all(part is not None for part in stacked):
        named, lead = list(zip(projs, stacked)), (E,)
    else:
        for prefix, names in _EXPERT_NAMINGS:
            named = [(p, get(f"model.layers.{layer}.{prefix}.experts.{e}.{names[p]}.weight"))
                     for e in range(E) for p in projs]
            if all(part is not None for _, part in named):
                break
        else:
            raise ModelLoadError(f"{source}: layer {layer}'s experts are missing: expected model.layers.{layer}"
                                 f".mlp.experts.{{0..{E - 1}}}.{projs[0]}.weight (or Mixtral's names)")
        lead = ()
    for proj, part in named:
        if tuple(part.shape) != (*lead, *shapes[proj]):
            raise ModelLoadError(f"{source}: layer {layer}'s experts' {proj} has shape {tuple(part.shape)}, "
                                 f"expected {(*lead, *shapes[proj])}")
    arrays = [part for _, part in named]
    if lead:  # [E, out, in] each
        return arrays[0] if len(projs) == 1 else map_rows(lambda *a: np.stack(a, axis=1), *arrays)
    per_expert = (E,) if len(projs) == 1 else (E, len(projs))  # arrays: expert-major, then proj
    return map_rows(lambda *a: np.stack(a).reshape(*per_expert, *a[0].shape), *arrays)


def build_params(
    config: ModelConfig, get: TensorSource, source: str, dtype: jnp.dtype, norm_offset: float = 0.0,
    layers: range | None = None, mesh: Mesh | None = None,
    prepare_layer: PrepareLayer | None = None,
) -> ModelParams:
    """Assemble and validate ``ModelParams`` from HF-named tensors, cast to ``dtype``; for a
    float32 model, bfloat16 and float16 projections, embedding and LM head stay 16-bit (the
    loaders return them so only with ``keep_blocks``; the dense kernels widen them exactly).

    ``norm_offset`` is added to every RMSNorm weight: HF's Gemma checkpoints store ``w`` for
    a norm that multiplies by ``1 + w`` (llama.cpp's GGUF files store ``1 + w`` already).

    ``layers`` (a pipeline stage's; default all) reads only those decoder layers' tensors, the
    embedding only for the first stage (and a tied head's last), the head only for the last: a
    stage's memory is its share of the weights (``layer_span_params``). The final norm (one
    vector) is always read: it carries the model dtype.

    ``mesh`` (several devices or hosts): each layer is put on its final shards as soon as it is
    built (``ParamPlacer``), so that one layer's unsharded copy at a time is what a process holds
    beyond its shards.

    ``prepare_layer`` (after placement) turns each layer into its served form as soon as it is
    built, before the next is read: the integer mode's packing (``Int8Packer.layer``), so that one
    layer's stored form at a time is held beside the packed ones."""
    get = deepseek_shared_experts(mixtral_router(unfused(get, config)))

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray | GgufBlocks | QuantArray:
        array = get(name)
        if array is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing (expected shape {shape})")
        if tuple(array.shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}"
            )
        return array

    def on_device(array: np.ndarray | GgufBlocks | QuantArray) -> jax.Array | GgufBlocks | QuantArray:
        if isinstance(array, (GgufBlocks, QuantArray)) and jnp.dtype(dtype) != jnp.float32:
            raise ModelLoadError(f"{source}: matrices are kept as stored only for a float32 model, "
                                 f"not {jnp.dtype(dtype)}")
        if isinstance(array, GgufBlocks):
            return array.to_device()
        if isinstance(array, QuantArray):
            return QuantArray(jnp.asarray(array.q), jnp.asarray(array.scale, jnp.float32))
        if array.dtype in HALF_DTYPES and jnp.dtype(dtype) == jnp.float32:
            return jnp.asarray(array)  # a 16-bit matrix kept as stored
        return jnp.asarray(array, dtype=dtype)

    def widened(array: np.ndarray | GgufBlocks | QuantArray) -> np.ndarray | GgufBlocks | QuantArray:
        """16-bit floats as float32: what no kernel reads at 16 bits (the grouped MoE kernel)."""
        return array.astype(np.float32) if isinstance(array, np.ndarray) and array.dtype in HALF_DTYPES else array

    H, KVH, D = config.num_heads, config.num_kv_heads, config.hidden_size

    def layer(i: int) -> LayerParams:
        def hf(field: str) -> np.ndarray | GgufBlocks | QuantArray:
            names = {**_HF_NAMES, **_SANDWICH_NAMES} if config.sandwich_norms else _HF_NAMES
            array = fetch((_PREFIX + names[field]).format(i=i), _hf_shape(field, config))
            if isinstance(array, (GgufBlocks, QuantArray)) or (array.dtype in HALF_DTYPES and field in _HALF_MATRICES):
                return array
            array = array.astype(np.float32, copy=False)
            return array + np.float32(norm_offset) if field in _NORMS and norm_offset else array

        wo = hf("wo")
        fields = {
            "attn_norm": hf("attn_norm"),
            "wo": _with_input_shape(wo, (H, config.attn_out_dim)),
            "mlp_norm": hf("mlp_norm"),
        }
        if config.mla is None:
            fields["wqkv"] = map_rows(lambda q, k, v: fuse_qkv(q, k, v, KVH), hf("wq"), hf("wk"), hf("wv"))
        else:
            fields.update(latent_attention_tensors(fetch, config, i))
        if config.is_sparse(i) and config.moe.expert_bias:  # (gpt-oss: its stacked, biased experts)
            fields.update(gpt_oss_moe_fields(get, config, i))
        elif config.is_sparse(i):
            fields.update(
                router=dequantized(hf("router")),
                w_experts_gate_up=widened(stacked_experts(get, config, i, ("gate_proj", "up_proj"), source)),
                w_experts_down=widened(stacked_experts(get, config, i, ("down_proj",), source)),
            )
            if config.moe.shared_expert_size:
                fields.update(
                    w_shared_gate_up=map_rows(lambda g, u: np.stack([g, u]), hf("shared_gate_proj"), hf("shared_up")),
                    w_shared_down=hf("shared_down"),
                )
                if config.moe.shared_expert_gated:
                    fields["shared_gate"] = dequantized(hf("shared_gate")).reshape(D)
            if config.moe.deepseek is not None and config.moe.deepseek.score_correction:
                fields["router_score_bias"] = dequantized(hf("router_score_bias"))
        else:
            fields.update(
                w_gate_up=map_rows(lambda g, u: np.stack([g, u]), hf("w_gate"), hf("w_up")),
                w_down=hf("w_down"),
            )
        if config.attention_bias:
            fields["bqkv"] = fuse_qkv(hf("bq"), hf("bk"), hf("bv"), KVH)
        if config.o_proj_bias:
            fields["bo"] = hf("bo")
        if config.attention_sinks:
            fields["sinks"] = hf("sinks")
        if config.qk_norm:
            fields.update(q_norm=hf("q_norm"), k_norm=hf("k_norm"))
        if config.sandwich_norms:
            fields.update(post_attn_norm=hf("post_attn_norm"), post_mlp_norm=hf("post_mlp_norm"))
        return LayerParams(**{f: jnp.asarray(a, jnp.float32) if f in _FLOAT32_FIELDS else on_device(a)
                              for f, a in fields.items()})

    V = config.vocab_size
    layers = range(config.num_layers) if layers is None else layers
    with_embed, with_head = stage_ends(layers.start == 0, layers.stop == config.num_layers, config.tie_word_embeddings)
    placer = None if mesh is None else ParamPlacer(config, mesh)
    place_layer = (lambda lp: lp) if placer is None else placer.layer
    served_layer = place_layer if prepare_layer is None else (lambda lp: prepare_layer(place_layer(lp)))

    def place(name: str, leaf: Any) -> Any:
        return leaf if placer is None else placer.model_field(name, leaf)

    embed = place("embed", on_device(fetch("model.embed_tokens.weight", (V, D)))) if with_embed else None
    lm_head = place("lm_head", on_device(fetch("lm_head.weight", (V, D)))) if with_head else None
    params = ModelParams(
        embed=embed,
        layers=tuple(served_layer(layer(i)) for i in layers),
        final_norm=place("final_norm", jnp.asarray(
            fetch("model.norm.weight", (D,)).astype(np.float32) + np.float32(norm_offset), dtype=dtype)),
        lm_head=lm_head,
    )
    # The fused layout against model/decoder/params.py's declarations.
    wrong = shape_mismatches(params, config.layer_slice(layers.start, layers.stop))
    if wrong:
        raise ModelLoadError(f"{source}: built parameters have unexpected shapes: " + "; ".join(wrong))
    return params
