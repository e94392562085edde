"""The runner an engine steps: one ``ModelRunner`` over the replica's mesh, or with
``pipeline_parallel_size > 1`` a ``PipelineRunner`` over stages (workers/pipeline/)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import jax.numpy as jnp

from raylm.cache.kv_budget import blocks_for_budget, group_blocks_for_budget
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.kv_pool import KVCache, create_pools
from raylm.model.loaders.load import LoadedModel
from raylm.model.runtime.buckets import cdiv
from raylm.model.runtime.sharding import make_mesh
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.pipeline.pipeline_runner import LocalStage, PipelineRunner
from raylm.workers.pipeline.stage_runners import split_layers
from raylm.workers.pipeline.stage_spec import StageSpec, build_stage
from raylm.workers.runner.model_runner import ModelRunner
from raylm.workers.runner.speculative_step import DraftModel


def build_runner(model: LoadedModel, config: ModelConfig, args: EngineArgs, max_model_len: int,
                 eos_ids: frozenset[int], blocks: tuple[int, int | None], kv_dtype: jnp.dtype,
                 draft: LoadedModel | None, runner_type: Callable[..., ModelRunner] = ModelRunner,
                 ) -> ModelRunner | PipelineRunner:
    """The replica's runner over ``blocks`` pool blocks (and the sliding group's, or None): a
    ``runner_type`` (a multi-host leader's relays its launches), or a pipeline's."""
    if args.pipeline_parallel_size > 1:
        return build_pipeline(model, args, max_model_len, eos_ids, blocks, kv_dtype)
    mesh = make_mesh(args.tensor_parallel_size, ep=args.expert_parallel_size)
    return runner_type(
        config, model.params, create_pools(config, blocks, args.block_size, kv_dtype, mesh), mesh,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, eos_ids=eos_ids, speculative=args.speculative,
        draft=DraftModel(
            draft.config, draft.params, KVCache.create(draft.config, blocks[0], args.block_size, kv_dtype, mesh)
        ) if draft else None,
        hidden_state_buffers=(args.hidden_state_slots, args.hidden_state_max_tokens),
        lora_buffers=(args.max_loras, args.max_lora_rank, args.lora_dtype) if args.enable_lora else None,
        gpu_attention=args.gpu_attention,
    )


def stage_specs(model: LoadedModel, args: EngineArgs, max_model_len: int, eos_ids: frozenset[int],
                blocks: tuple[int, int | None], kv_dtype: jnp.dtype) -> list[StageSpec]:
    """Every stage's spec: its layers and the replica's shared shapes."""
    return [
        StageSpec(
            span=span, model_path=str(model.path), dtype=args.dtype, quantization=args.quantization,
            keep_blocks=args.keep_gguf_blocks(), activation_quantization=args.activation_quantization,
            num_blocks=blocks, block_size=args.block_size, kv_dtype=jnp.dtype(kv_dtype).name,
            tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len, eos_ids=eos_ids,
            lora_buffers=(args.max_loras, args.max_lora_rank, args.lora_dtype) if args.enable_lora else None,
            compilation_cache_dir=args.compilation_cache_dir,
        )
        for span in split_layers(model.config.num_layers, args.pipeline_parallel_size)
    ]


def build_pipeline(model: LoadedModel, args: EngineArgs, max_model_len: int, eos_ids: frozenset[int],
                   blocks: tuple[int, int | None], kv_dtype: jnp.dtype) -> PipelineRunner:
    """The stages: the last in this process from ``model`` (the engine's, whole or its slice),
    the others started where ``args.pipeline_placement`` says, each reading its own layers."""
    specs = stage_specs(model, args, max_model_len, eos_ids, blocks, kv_dtype)
    if args.pipeline_placement == "local":
        stages = [LocalStage(build_stage(spec, model if model.layers is None else None), spec.span)
                  for spec in specs[:-1]]
    else:
        from raylm.workers.pipeline.ray_stages import start_ray_stages

        stages = start_ray_stages(specs[:-1], args.pipeline_placement)
    return PipelineRunner(stages, build_stage(specs[-1], model), specs[-1].span)


def kv_block_counts(
    config: ModelConfig, args: EngineArgs, kv_dtype: jnp.dtype, draft_config: ModelConfig | None, decode_tokens: int,
    stage_layers: Sequence[tuple[int, ...]] | None = None,
) -> tuple[int, int | None]:
    """Blocks of the pool (of the full-attention group's, with a sliding group) and of the
    sliding group's (None without one), for a replica (or its largest pipeline stage) of
    ``config``. ``num_kv_blocks`` gives each group that many; a memory budget gives the sliding
    group what its sequences can hold at once (each running sequence its window and a decode step
    of ``decode_tokens``, a step's prompt chunks on top, a block of misalignment each), as far as
    an even split allows, and the full group the rest. ``stage_layers``: each pipeline stage's
    layers per group (``stage_kv_group_layers``; default ``config``'s own)."""
    window = config.sliding_window
    if args.num_kv_blocks:
        return args.num_kv_blocks, None if window is None else args.num_kv_blocks
    budget = (args.kv_cache_memory_bytes, args.kv_cache_memory_fraction)
    if window is None:
        return blocks_for_budget(config, args.block_size, kv_dtype, *budget, draft_config=draft_config), None
    wanted = (args.max_num_seqs * (cdiv(window + decode_tokens, args.block_size) + 2)
              + cdiv(args.max_num_batched_tokens, args.block_size) + 1)
    return group_blocks_for_budget(config, args.block_size, kv_dtype, *budget, wanted, draft_config=draft_config,
                                   stage_layers=stage_layers)
