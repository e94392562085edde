"""What builds one pipeline stage, as plain data: a stage actor on another node gets this and
reads its own layers from the checkpoint (never the whole model)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import create_pools
from raylm.model.decoder.params import ModelParams, stage_ends
from raylm.model.loaders.load import LoadedModel, load_model
from raylm.model.runtime.compilation_cache import enable_compilation_cache
from raylm.model.runtime.host_memory import release_freed_heap
from raylm.model.runtime.sharding import make_mesh
from raylm.workers.pipeline.stage_runners import HiddenStageRunner, LastStageRunner, StageSpan


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A stage's layers, where its weights come from, and the replica's shapes it shares."""

    span: StageSpan
    model_path: str
    dtype: str
    quantization: str | None
    keep_blocks: bool
    activation_quantization: str
    num_blocks: tuple[int, int | None]  # the pool's blocks and the sliding group's (None: one group)
    block_size: int
    kv_dtype: str
    tensor_parallel_size: int
    expert_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_ids: frozenset[int]
    lora_buffers: tuple[int, int, str | None] | None
    compilation_cache_dir: str | None = None


def stage_params(params: ModelParams, config: ModelConfig, span: StageSpan) -> ModelParams:
    """A whole model's ``params`` cut to ``span`` as the loader reads a stage's alone
    (``model.loaders.hf_tensors.build_params``): no copy of any array."""
    with_embed, with_head = stage_ends(span.is_first, span.is_last, config.tie_word_embeddings)
    return dataclasses.replace(params, layers=params.layers[span.start:span.stop],
                               embed=params.embed if with_embed else None, lm_head=params.lm_head if with_head else None)


def stage_model(spec: StageSpec, model: LoadedModel | None = None) -> LoadedModel:
    """The stage's model: cut from ``model`` when given (the engine's, whole or this very
    stage's slice, already quantized as served), else read from the checkpoint by slice and
    quantized as the replica serves it."""
    layers = range(spec.span.start, spec.span.stop)
    if model is not None:
        if model.layers is None:
            return dataclasses.replace(model, params=stage_params(model.params, model.config, spec.span),
                                       layers=layers)
        if model.layers != layers:
            raise ValueError(f"a model holding layers {model.layers} cannot serve stage layers {layers}")
        return model
    model = load_model(spec.model_path, spec.dtype, spec.quantization, spec.keep_blocks, layers=layers,
                       activation_quantization=spec.activation_quantization)
    release_freed_heap()  # the load's and the packing's temporaries (model/runtime/host_memory.py)
    return model


def build_stage(spec: StageSpec, model: LoadedModel | None = None) -> HiddenStageRunner | LastStageRunner:
    """The runner of stage ``spec.span`` over its own layers and its part of the KV pool."""
    if spec.compilation_cache_dir:
        enable_compilation_cache(spec.compilation_cache_dir)
    model = stage_model(spec, model)
    config = model.config.served_at(spec.max_model_len).layer_slice(spec.span.start, spec.span.stop, stage=True)
    mesh = make_mesh(spec.tensor_parallel_size, ep=spec.expert_parallel_size)
    kv = create_pools(config, spec.num_blocks, spec.block_size, jnp.dtype(spec.kv_dtype), mesh)
    kwargs = dict(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                  max_model_len=spec.max_model_len, eos_ids=spec.eos_ids, lora_buffers=spec.lora_buffers)
    if spec.span.is_last:
        return LastStageRunner(config, model.params, kv, mesh, **kwargs)
    return HiddenStageRunner(config, model.params, kv, mesh, first=spec.span.is_first, **kwargs)

