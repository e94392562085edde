"""The router's knobs, filled in from the deploy YAML's ``router`` and ``model`` sections."""

from __future__ import annotations

import dataclasses

from raylm.cluster.names import DEFAULT_APP_NAME
from raylm.router.auth import Secret


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """What the ingress needs to parse, validate and forward requests for one model."""

    model: str  # registry name or path: the router loads its tokenizer and config, not its weights
    served_model_name: str  # the name clients send as ``model``
    # The workers' engine args, as the app builder read them (the router never imports the engine)
    max_model_len: int  # must equal the workers'
    slots_per_replica: int  # their max_num_seqs: at most this x replicas / router replicas in flight
    block_size: int  # for prefix hashing: must match the workers' block pool
    max_request_bytes: int = 1 << 20
    health_check_timeout_s: float = 10.0
    app_name: str = DEFAULT_APP_NAME  # the Serve application (to find the worker replicas)
    # Queueing and fairness
    priority_classes: tuple[str, ...] = ("high", "normal", "low")  # most urgent first
    default_priority: str = "normal"
    max_queue_size: int = 256  # per priority class
    queue_timeout_s: float = 60.0
    tenant_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    num_router_replicas: int = 1
    stats_period_s: float = 1.0
    # Security
    api_keys: Secret = dataclasses.field(default_factory=lambda: Secret({}))
    api_keys_env: str | None = "RAYLM_API_KEYS"
    # Keys that may also load and unload LoRA adapters (with any key configured, only these may)
    admin_api_keys: Secret = dataclasses.field(default_factory=lambda: Secret({}))
    admin_api_keys_env: str | None = "RAYLM_ADMIN_API_KEYS"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tool_call_parser: str = "auto"  # router/tool_formats.py: how tool calls are written and read back
    reasoning_parser: str = "auto"  # router/reasoning.py: where a thinking model's thoughts are
    cache_salt: str = ""
    # /v1/responses: the cluster's store of responses (cluster/response_store.py), oldest evicted first
    responses_store_max_bytes: int = 256 << 20
    responses_store_max_age_s: float = 24 * 3600.0
    # LoRA adapters served beside the model (deploy file's model.lora_modules): name -> path.
    # A request whose ``model`` is one of them generates with it. With the workers' enable_lora,
    # more may be loaded over HTTP, each of rank up to their max_lora_rank.
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    enable_lora: bool = False
    max_lora_rank: int = 16
    # Prefill/decode disaggregation (deploy file's prefill_workers): the longest the router waits for
    # one prompt's prefill (queue, compute, publish) before a decode replica computes it instead.
    prefill_timeout_s: float = 60.0
