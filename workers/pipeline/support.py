"""What pipeline parallelism serves, what it refuses at load, and what it sizes by."""

from __future__ import annotations

from raylm.model.config.model_config import ModelConfig
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.pipeline.stage_runners import split_layers


def check_pipeline(args: EngineArgs, config: ModelConfig) -> None:
    """Refuse, naming the setting, what the stages do not run: every such feature needs its state
    on every stage (a draft model's pool, hidden-state buffers, multi-step decode's sampled
    tokens fed back inside one program) or reads the whole pool in one process (KV offload)."""
    pp = args.pipeline_parallel_size
    if pp == 1:
        return
    split_layers(config.num_layers, pp)  # (raises on more stages than layers)
    refused = {
        "speculative": args.speculative is not None,
        "num_scheduler_steps > 1": args.num_scheduler_steps > 1,
        "hidden_state_slots": args.hidden_state_slots > 0,
        "kv_offload": args.kv_offload is not None,
    }
    for setting, on in refused.items():
        if on:
            raise ValueError(f"pipeline_parallel_size={pp} does not combine with {setting}; remove one of them")


def largest_stage(config: ModelConfig, pipeline_parallel_size: int) -> ModelConfig:
    """The config of the stage holding the most layers (the first): each stage's pool has as
    many blocks, so that stage's memory decides how many fit the budget."""
    span = split_layers(config.num_layers, pipeline_parallel_size)[0]
    return config.layer_slice(span.start, span.stop, stage=True)


def stage_kv_group_layers(config: ModelConfig, pipeline_parallel_size: int) -> list[tuple[int, ...]]:
    """Each stage's layers in each KV group (``kv_group_layers``; one group, or two for a model
    whose local layers keep their own): every stage's pools have the replica's block counts, so
    a budget must fit each stage, and with two groups the stage holding the most layers need not
    be the one holding the most of either kind."""
    return [tuple(map(len, config.layer_slice(s.start, s.stop, stage=True).kv_group_layers))
            for s in split_layers(config.num_layers, pipeline_parallel_size)]


def last_stage_layers(name_or_path: str, pipeline_parallel_size: int) -> range:
    """The layers of a model's last stage (its config read without the weights)."""
    from raylm.model.config.model_info import load_model_info

    config = load_model_info(name_or_path).config
    span = split_layers(config.num_layers, pipeline_parallel_size)[-1]
    return range(span.start, span.stop)
