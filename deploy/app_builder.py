"""Deploy config -> Ray Serve application (router ingress bound to the worker deployment, and to a
prefill deployment beside it when the deploy file disaggregates prefill from decode).

``raylm serve`` calls ``build_application``; Serve config files point their ``import_path``
at ``raylm.deploy.app_builder:build_app``, whose ``args`` are ``{"config": "path.yaml"}`` or the deploy
config itself inline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from raylm.cluster.names import PREFILL_WORKER_DEPLOYMENT
from raylm.deploy.config import DeployConfig, WorkersSection, load_deploy_config, parse_deploy_config
from raylm.router.app import OpenAIRouter
from raylm.router.auth import parse_api_keys
from raylm.router.prefix_router import PrefixAwareRequestRouter
from raylm.router.settings import RouterSettings
from raylm.workers.serve.deployment import LLMWorker


def worker_actor_options(config: DeployConfig, workers: WorkersSection | None = None) -> dict[str, Any]:
    """Ray resources and environment of one replica of ``workers`` (default: the ``workers`` section)."""
    workers = workers or config.workers
    options: dict[str, Any] = {"num_cpus": workers.num_cpus, "num_gpus": workers.num_gpus}
    if workers.memory_bytes:
        options["memory"] = workers.memory_bytes
    devices = workers.tensor_parallel_size * workers.expert_parallel_size // workers.num_hosts  # on each host
    if (devices > 1 or workers.num_hosts > 1) and workers.num_gpus == 0:
        # Tensor / expert parallelism on CPU needs one XLA host device per shard (exactly: a mesh
        # over hosts takes every device of every host).
        flags = f"--xla_force_host_platform_device_count={devices}"
        options["runtime_env"] = {"env_vars": {"XLA_FLAGS": flags}}
    return options


def replica_placement(config: DeployConfig, workers: WorkersSection) -> dict[str, Any]:
    """A replica of several processes is one placement group of one bundle each (what the section
    reserves for a replica), so Serve places, starts and removes them as one unit: its pipeline
    stages (the replica is the last; workers/pipeline/ray_stages.py takes the other bundles), or the
    hosts its mesh spans (the replica leads; workers/serve/multihost_actors.py); none for a replica
    of one process."""
    if workers.pipeline_parallel_size > 1:
        count, strategy = workers.pipeline_parallel_size, "SPREAD" if workers.pipeline_placement == "spread" else "PACK"
    elif workers.num_hosts > 1:
        count, strategy = workers.num_hosts, workers.host_placement
    else:
        return {}
    options = worker_actor_options(config, workers)
    bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {}),
              **({"memory": options["memory"]} if "memory" in options else {})}
    return {"placement_group_bundles": [dict(bundle) for _ in range(count)], "placement_group_strategy": strategy}


def build_application(config: DeployConfig) -> Application:
    """The router ingress bound to the worker deployment (role both, or decode) and, for a
    disaggregated deploy file, the prefill deployment."""
    prefill = None
    if config.prefill_workers is not None:
        # Prefix-aware among prefill replicas: a prompt whose prefix one of them holds computes less.
        prefill = _worker_deployment(config, config.prefill_workers, "prefill", PREFILL_WORKER_DEPLOYMENT,
                                     config.router.prefix_routing.imbalance_threshold_tokens)
    # Decode replicas find every prompt's blocks in the cluster tier, so load decides among them
    # (a held prefix only breaks ties).
    threshold = 0 if prefill is not None else config.router.prefix_routing.imbalance_threshold_tokens
    worker = _worker_deployment(config, config.workers, config.worker_role, None, threshold)
    return OpenAIRouter.options(
        num_replicas=config.router.num_replicas,
        ray_actor_options={"num_cpus": config.router.num_cpus},
    ).bind(worker, router_settings(config), prefill)


def _worker_deployment(config: DeployConfig, workers: WorkersSection, role: str, name: str | None,
                       imbalance_threshold_tokens: int) -> Application:
    """One group of worker replicas (``name``: its deployment's, when not the default ``LLMWorker``)."""
    scaling: dict[str, Any]
    if workers.autoscaling_config is not None:
        scaling = {"autoscaling_config": workers.autoscaling_config.serve_config()}
    else:
        scaling = {"num_replicas": workers.num_replicas or 1}
    engine_args = config.engine_args(workers)
    routing = config.router.prefix_routing
    router_config: dict[str, Any] = {"request_routing_stats_period_s": routing.stats_period_s,
                                     "request_routing_stats_timeout_s": max(5.0, 5 * routing.stats_period_s)}
    if routing.enabled:
        router_config.update(
            request_router_class=PrefixAwareRequestRouter,
            request_router_kwargs={"imbalance_threshold_tokens": imbalance_threshold_tokens,
                                   # a completed prompt shows in the replica's report within a period
                                   # or two; until then the router's own record says where it went
                                   "report_grace_s": 2 * routing.stats_period_s + 1.0,
                                   "block_size": engine_args.block_size,
                                   "model": config.served_model_name},
        )
    # A KV handoff waits for the tiers as long as a load from them may take.
    handoff = {} if engine_args.kv_offload is None else {"kv_handoff_timeout_s": engine_args.kv_offload.load_timeout_s}
    return LLMWorker.options(
        **({"name": name} if name is not None else {}),
        **scaling,
        **replica_placement(config, workers),
        request_router_config=RequestRouterConfig(**router_config),
        ray_actor_options=worker_actor_options(config, workers),
        **workers.deployment_options().serve_options(),
    ).bind(
        config.model.name, dataclasses.asdict(engine_args), workers.stuck_after_s,
        served_model_name=config.served_model_name, lora_modules=config.model.lora_requests(),
        role=role, **handoff,
    )


# The router section's keys that are RouterSettings fields of the same name and meaning.
_SHARED_ROUTER_KEYS = {"max_request_bytes", "default_priority", "max_queue_size", "queue_timeout_s", "api_keys_env",
                       "admin_api_keys_env"}


def router_settings(config: DeployConfig) -> RouterSettings:
    """The ingress's settings: the router section's knobs (defaults declared by RouterSettings),
    plus what follows from the model, the engine and the application."""
    router, engine_args = config.router, config.engine_args()
    return RouterSettings(
        **router.model_dump(include=_SHARED_ROUTER_KEYS),
        model=config.model.name,
        served_model_name=config.served_model_name,
        max_model_len=engine_args.resolve_max_model_len(_max_positions(config.model.name)),
        app_name=config.name,
        priority_classes=tuple(router.priority_classes),
        tenant_weights=dict(router.tenant_weights),
        slots_per_replica=engine_args.max_num_seqs,
        num_router_replicas=router.num_replicas,
        stats_period_s=router.prefix_routing.stats_period_s,
        api_keys=parse_api_keys(router.api_keys, None),
        admin_api_keys=parse_api_keys(router.admin_api_keys, None),
        requests_per_minute=router.rate_limits.requests_per_minute,
        tokens_per_minute=router.rate_limits.tokens_per_minute,
        block_size=engine_args.block_size,
        tool_call_parser=config.model.tool_call_parser,
        reasoning_parser=config.model.reasoning_parser,
        cache_salt=engine_args.cache_salt(config.model.name),
        # the workers' LoRARequests, by name: the router resolves a name to the same request (id)
        lora_modules={r.lora_name: r.lora_path for r in config.model.lora_requests()},
        enable_lora=engine_args.enable_lora,
        max_lora_rank=engine_args.max_lora_rank,
        responses_store_max_bytes=router.responses_store.max_bytes,
        responses_store_max_age_s=router.responses_store.max_age_s,
        **({"prefill_timeout_s": config.prefill_workers.timeout_s} if config.prefill_workers is not None else {}),
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder: ``args`` is ``{"config": PATH}`` or a deploy config mapping."""
    if set(args) == {"config"} and isinstance(args["config"], str):
        return build_application(load_deploy_config(args["config"]))
    if set(args) == {"config"}:
        args = args["config"]
    return build_application(parse_deploy_config(args, "Serve application args"))


def _max_positions(model: str) -> int:
    from raylm.model.config.model_info import load_model_info

    return load_model_info(model).config.max_position_embeddings
