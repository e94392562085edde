"""The deploy YAML: one file describes the model, the worker replicas, the engine, the router
and HTTP. Validated up front; errors name the bad key by its path (``workers.num_cpus``).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt

from raylm.cache.offload.config import KVOffloadConfig
from raylm.cluster.names import DEFAULT_APP_NAME
from raylm.deploy.byte_sizes import ByteSize, format_bytes
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.router.settings import RouterSettings
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.speculation import SpeculativeConfig
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.serve.deployment_options import DEFAULT_STUCK_AFTER_S, WorkerDeploymentOptions


class DeployConfigError(ValueError):
    """The deploy file is missing, unreadable or invalid; the message lists every problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraModuleSection(_Section):
    """One entry of ``model.lora_modules``: a PEFT LoRA adapter directory served under ``name``."""

    name: str = Field(min_length=1, description="what requests send as model to use the adapter")
    path: str = Field(min_length=1, description="directory with adapter_config.json and adapter_model.safetensors")


class ModelSection(_Section):
    name: str = Field(DEFAULT_MODEL, description="registry name (e.g. smollm2-135m-instruct) or a path")
    served_model_name: str | None = Field(None, description="the name clients send; default: name")
    dtype: Literal["float32", "bfloat16"] = "float32"
    quantization: Literal["none", "int8", "int8_g32", "fp8"] = Field(
        "none", description="weight-only: every matrix stored 8-bit with a scale per output channel (int8_g32: per "
        "32 inputs)")
    activation_quantization: Literal["none", "int8"] = Field(
        "none", description="int8: the integer compute mode, activations quantized per 32 inputs and summed in "
        "integers against GGUF block and int8 weights (faster, not exact; README); none: exact float32 sums")
    gguf_blocks: Literal["auto", "keep", "expand"] = Field(
        "auto", description="a GGUF's block-quantized matrices (Q4_0..Q8_0, K-quants, IQ4), 4-bit HF groups and "
        "16-bit matrices: kept as stored (exact float32 results from a fifth to a half of the bytes; auto: on one "
        "CPU device in float32) or expanded to float32 at load")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "glm45", "deepseek_v3", "qwen3_coder",
                              "pythonic", "harmony"] = Field(
        RouterSettings.tool_call_parser, description="the format tool calls are written and read in "
        "(router/tool_formats.py); auto: the chat template's")
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "harmony", "none"] = Field(
        RouterSettings.reasoning_parser, description="where a thinking model's thoughts are, to return them as "
        "reasoning_content (router/reasoning.py); auto: the chat template's")
    lora_modules: list[LoraModuleSection] = Field(
        [], description="LoRA adapters served beside the base model (turns engine.enable_lora on)")

    @pydantic.model_validator(mode="after")
    def _distinct_adapters(self) -> "ModelSection":
        names = [m.name for m in self.lora_modules]
        clashes = sorted({n for n in names if names.count(n) > 1} | ({self.name, self.served_model_name} & set(names)))
        if clashes:
            raise ValueError(f"lora_modules names must be distinct and differ from the model's: {clashes}")
        return self

    def lora_requests(self) -> list[LoRARequest]:
        """The adapters as the engine takes them (ids in file order, from 1)."""
        return [LoRARequest(m.name, i, str(Path(m.path).expanduser())) for i, m in enumerate(self.lora_modules, 1)]


class NgramSection(_Section):
    min: PositiveInt = SpeculativeConfig.ngram_min
    max: PositiveInt = SpeculativeConfig.ngram_max


class SpeculativeSection(_Section):
    """``engine.speculative``: see workers/core/speculation.py (its checks run on the result)."""

    method: Literal["draft", "ngram"] = "draft"
    model: str | None = Field(None, description="draft checkpoint; default: cut from the served model")
    num_layers: PositiveInt | None = Field(None, description="a draft cut from the model: layers it keeps")
    quantization: Literal["int8", "fp8"] | None = Field(None, description="the cut draft's weights")
    num_speculative_tokens: PositiveInt = SpeculativeConfig.num_speculative_tokens
    ngram: NgramSection = NgramSection()
    disable_by_batch_size: PositiveInt | None = None


class KVOffloadSection(_Section):
    """``engine.kv_offload``: the tiers a replica keeps KV blocks in beyond its pool
    (cache/offload/config.py; docs/kv_offload.md). Sizes take units (deploy/byte_sizes.py: ``8GiB``,
    ``512MB``); a tier of size 0 is off, and with every tier off so is offload."""

    host_bytes: ByteSize = Field(0, description="this replica's memory for blocks beyond its pool")
    cluster_bytes: ByteSize = Field(0, description="Ray's object store, shared by every replica: what "
                                    "the cluster tier may hold in all")
    disk_path: str | None = Field(None, description="an absolute directory (~ expands) for the disk tier: "
                                  "it survives restarts")
    disk_bytes: ByteSize = Field(0, validate_default=True, description="what the disk tier may hold")
    load_timeout_s: float = Field(KVOffloadConfig.load_timeout_s, gt=0, allow_inf_nan=False,
                                  description="a load from the cluster tier taking longer is computed instead")

    @pydantic.field_validator("disk_path")
    @classmethod
    def _absolute_directory(cls, path: str | None) -> str | None:
        """``~`` expanded when the file is read, as ``model.lora_modules`` paths are. A relative path
        would land in the directory each replica happens to run in (Ray's copy of the working
        directory, gone with the replica): the warm restart the disk tier is for would not happen."""
        if path is None:
            return None
        expanded = Path(path).expanduser()
        if not expanded.is_absolute():
            raise ValueError("must be an absolute directory (or start with ~): replicas run in Ray's "
                             "temporary working directories")
        return str(expanded)

    @pydantic.field_validator("disk_bytes")
    @classmethod
    def _disk_tier_whole(cls, size: int, info: pydantic.ValidationInfo) -> int:
        """The disk tier needs both its directory and its size; one without the other is a mistake."""
        if "disk_path" not in info.data:  # disk_path itself was wrong: that error says so
            return size
        path = info.data["disk_path"]
        if size > 0 and path is None:
            raise ValueError("the disk tier needs engine.kv_offload.disk_path, the directory to keep blocks in")
        if size == 0 and path is not None:
            raise ValueError(f"engine.kv_offload.disk_path is {path!r}, but the disk tier has no size: "
                             "give disk_bytes (e.g. 64GiB), or remove disk_path")
        return size


# Engine settings come from EngineArgs itself so the YAML can never drift from the engine.
_ENGINE_OWNED_ELSEWHERE = {"dtype", "quantization", "activation_quantization", "gguf_blocks", "tensor_parallel_size",
                           "expert_parallel_size", "pipeline_parallel_size", "pipeline_placement", "num_hosts"}
_ENGINE_SECTIONS = {"speculative": (SpeculativeSection | None, None),  # nested: their own schemas
                    "kv_offload": (KVOffloadSection | None, None)}
_engine_hints = typing.get_type_hints(EngineArgs)
EngineSection = pydantic.create_model(
    "EngineSection",
    __base__=_Section,
    **{
        f.name: _ENGINE_SECTIONS.get(f.name, (_engine_hints[f.name], f.default))
        for f in dataclasses.fields(EngineArgs)
        if f.name not in _ENGINE_OWNED_ELSEWHERE
    },
)


class AutoscalingSection(_Section):
    """Serve's autoscaling knobs for the worker deployment (see Serve's AutoscalingConfig)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 1
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: PositiveFloat = 16.0
    metrics_interval_s: PositiveFloat = 10.0
    look_back_period_s: PositiveFloat = 30.0
    upscale_delay_s: NonNegativeFloat = 30.0
    downscale_delay_s: NonNegativeFloat = 600.0
    policy: Literal["requests", "llm"] = Field(
        "requests", description="requests: Serve's ongoing-requests policy; llm: batch slots, KV use, queued tokens")
    target_batch_utilization: float = Field(0.75, gt=0, le=1, description="llm policy: running / max_num_seqs")
    target_kv_usage: float = Field(0.8, gt=0, le=1, description="llm policy: KV blocks in use")
    target_waiting_tokens: PositiveFloat = Field(2048.0, description="llm policy: prompt tokens queued per replica")

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` for these settings."""
        llm_keys = {"policy", "target_batch_utilization", "target_kv_usage", "target_waiting_tokens"}
        config = self.model_dump(exclude_none=True, exclude=llm_keys)
        if self.policy == "llm":
            from raylm.cluster.autoscaling import POLICY_IMPORT_PATH

            config["policy"] = {
                "policy_function": POLICY_IMPORT_PATH,
                "policy_kwargs": {k: getattr(self, k) for k in sorted(llm_keys - {"policy"})},
            }
        return config

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSection":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self


_WORKER_DEFAULTS = WorkerDeploymentOptions()
_WORKER_OPTION_NAMES = [f.name for f in dataclasses.fields(WorkerDeploymentOptions)]


class WorkersSection(_Section):
    role: Literal["both", "decode", "prefill"] | None = Field(
        None, description="both: each replica computes prompts and streams (the default alone); decode: beside "
        "prefill_workers, the replicas that load the prompts' KV from the cluster tier and stream (the default there)")
    num_replicas: PositiveInt | None = Field(None, description="fixed replica count (default 1)")
    autoscaling_config: AutoscalingSection | None = None
    num_cpus: NonNegativeFloat = 1.0
    num_gpus: NonNegativeFloat = 0.0
    memory_bytes: int | None = Field(None, gt=0, description="Ray memory resource reserved per replica")
    tensor_parallel_size: PositiveInt = 1
    expert_parallel_size: PositiveInt = Field(1, description="devices a mixture of experts' experts are split over")
    pipeline_parallel_size: PositiveInt = Field(
        1, description="stages a replica's layers are split into, each a Ray actor with its layers' weights and KV "
        "(the replica itself is the last), reserving this section's num_cpus / num_gpus / memory_bytes each")
    pipeline_placement: Literal["spread", "pack"] = Field(
        "spread", description="a replica's stages on different nodes where the cluster allows (spread), or on as "
        "few as they fit (pack)")
    num_hosts: PositiveInt = Field(1, description="nodes a replica's tensor x expert mesh spans (jax.distributed): "
                                   "one process per node, each with mesh / num_hosts devices")
    host_placement: Literal["STRICT_SPREAD", "SPREAD", "PACK"] = Field(
        "STRICT_SPREAD", description="num_hosts > 1: where the hosts' processes go (Ray's placement group "
        "strategy): one per node, or PACK them on as few nodes as hold them (e.g. a one-node test)")
    max_ongoing_requests: PositiveInt = _WORKER_DEFAULTS.max_ongoing_requests
    max_queued_requests: int = Field(_WORKER_DEFAULTS.max_queued_requests,
                                     description="per router replica; beyond it requests get 503 (-1: no limit)")
    graceful_shutdown_timeout_s: NonNegativeFloat = _WORKER_DEFAULTS.graceful_shutdown_timeout_s
    health_check_period_s: PositiveFloat = _WORKER_DEFAULTS.health_check_period_s
    health_check_timeout_s: PositiveFloat = _WORKER_DEFAULTS.health_check_timeout_s
    stuck_after_s: PositiveFloat = Field(DEFAULT_STUCK_AFTER_S,
                                         description="one engine step running longer fails the health check")

    def deployment_options(self) -> WorkerDeploymentOptions:
        return WorkerDeploymentOptions(**self.model_dump(include=set(_WORKER_OPTION_NAMES)))

    @pydantic.model_validator(mode="after")
    def _one_way_to_scale(self) -> "WorkersSection":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give either num_replicas or autoscaling_config, not both")
        return self

    @pydantic.model_validator(mode="after")
    def _gpus_cover_the_mesh(self) -> "WorkersSection":
        """A replica's mesh is tensor_parallel_size x expert_parallel_size devices over num_hosts
        nodes, the same number on each: on GPUs Ray must reserve exactly that many for each
        host's actor (it places an actor's resources on one node), or JAX would see fewer devices
        than the mesh needs, or hold idle ones. ``num_gpus`` is per host."""
        devices = self.tensor_parallel_size * self.expert_parallel_size
        if devices % self.num_hosts:
            raise ValueError(f"workers.num_hosts is {self.num_hosts} but tensor_parallel_size x expert_parallel_size "
                             f"is {devices}: each host gives the mesh the same number of devices")
        if self.num_gpus > 0 and self.num_gpus != devices // self.num_hosts:
            raise ValueError(f"workers.num_gpus is {self.num_gpus:g} but tensor_parallel_size x expert_parallel_size "
                             f"is {devices} over num_hosts={self.num_hosts}: a replica needs one GPU per device of "
                             f"its mesh, {devices // self.num_hosts} on each host")
        return self


class PrefillWorkersSection(WorkersSection):
    """``prefill_workers``: a disaggregated application's prefill replicas, beside ``workers`` (which
    then decode). The schema of ``workers`` (role: prefill, if given), plus the router's wait."""

    timeout_s: PositiveFloat = Field(RouterSettings.prefill_timeout_s, description="the router's wait for one "
                                     "prompt's prefill (queue, compute, publish); past it a decode replica computes it")


class PrefixRoutingSection(_Section):
    enabled: bool = Field(True, description="prefix-aware replica choice; false: Serve's power of two choices")
    imbalance_threshold_tokens: int = Field(2048, ge=0, description="load gap beyond which load wins over prefix")
    stats_period_s: PositiveFloat = Field(RouterSettings.stats_period_s,
                                          description="how often replicas report load and cached blocks")


class RateLimitSection(_Section):
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None


class ResponsesStoreSection(_Section):
    """The store of ``/v1/responses`` (one per application, shared by every router replica)."""

    max_bytes: PositiveInt = Field(RouterSettings.responses_store_max_bytes,
                                   description="stored responses' JSON bytes in all; beyond: the oldest are evicted")
    max_age_s: PositiveFloat = Field(RouterSettings.responses_store_max_age_s,
                                     description="a stored response older than this is gone (404)")


class RouterSection(_Section):
    num_replicas: PositiveInt = 1
    num_cpus: NonNegativeFloat = 0.0
    max_request_bytes: PositiveInt = RouterSettings.max_request_bytes
    priority_classes: list[str] = Field(list(RouterSettings.priority_classes), min_length=1,
                                        description="most urgent first")
    default_priority: str = RouterSettings.default_priority
    max_queue_size: PositiveInt = Field(RouterSettings.max_queue_size,
                                        description="waiting requests per priority class; beyond: 429")
    queue_timeout_s: PositiveFloat = Field(RouterSettings.queue_timeout_s,
                                           description="longest wait in the queue; beyond: 503")
    tenant_weights: dict[str, PositiveFloat] = Field({}, description="fair-share weights (default 1)")
    api_keys: list[str] | dict[str, str] = Field([], description="keys, or {key: tenant}; empty: no auth")
    api_keys_env: str | None = Field(RouterSettings.api_keys_env,
                                     description="env var with more keys (KEY or KEY=TENANT, comma-separated)")
    admin_api_keys: list[str] = Field([], description="keys that may also load and unload LoRA adapters over "
                                      "HTTP; with any key configured, only these may")
    admin_api_keys_env: str | None = Field(RouterSettings.admin_api_keys_env,
                                           description="env var with more admin keys (comma-separated)")
    rate_limits: RateLimitSection = RateLimitSection()
    prefix_routing: PrefixRoutingSection = PrefixRoutingSection()
    responses_store: ResponsesStoreSection = ResponsesStoreSection()

    @pydantic.model_validator(mode="after")
    def _classes(self) -> "RouterSection":
        if len(set(self.priority_classes)) != len(self.priority_classes):
            raise ValueError(f"priority_classes has duplicates: {self.priority_classes}")
        if self.default_priority not in self.priority_classes:
            raise ValueError(f"default_priority {self.default_priority!r} is not one of {self.priority_classes}")
        return self

    def __repr_args__(self):  # never print API keys
        for name, value in super().__repr_args__():
            yield name, ("<hidden>" if name in ("api_keys", "admin_api_keys") and value else value)


class HTTPSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class DeployConfig(_Section):
    """The whole deploy file."""

    name: str = Field(DEFAULT_APP_NAME, description="the Serve application name")
    route_prefix: str = "/"
    model: ModelSection = ModelSection()
    workers: WorkersSection = WorkersSection()
    prefill_workers: PrefillWorkersSection | None = Field(
        None, description="prefill/decode disaggregation: replicas that compute prompts for workers to decode")
    engine: EngineSection = EngineSection()  # type: ignore[valid-type]
    router: RouterSection = RouterSection()
    http: HTTPSection = HTTPSection()

    @pydantic.model_validator(mode="after")
    def _engine_args_valid(self) -> "DeployConfig":
        self.engine_args()  # EngineArgs' own checks (power-of-two block size, ...)
        if self.prefill_workers is not None:
            self.engine_args(self.prefill_workers)  # its mesh may differ
        return self

    @pydantic.model_validator(mode="after")
    def _host_tier_fits_the_replica(self) -> "DeployConfig":
        """The host tier lives in the replica's process: Ray reserving less memory for the whole
        replica than the tier alone may fill is a mistake (the weights and pool need theirs too)."""
        offload = self.engine.kv_offload
        for name, workers in (("workers", self.workers), ("prefill_workers", self.prefill_workers)):
            memory = workers.memory_bytes if workers is not None else None
            if offload is not None and memory is not None and offload.host_bytes > memory:
                raise ValueError(f"engine.kv_offload.host_bytes ({format_bytes(offload.host_bytes)}) exceeds "
                                 f"{name}.memory_bytes ({format_bytes(memory)}), the memory Ray reserves for a "
                                 "whole replica: raise memory_bytes or lower host_bytes")
        return self

    @pydantic.model_validator(mode="after")
    def _roles_fit(self) -> "DeployConfig":
        """Roles as ``worker_role`` reads them; disaggregation hands KV over through the cluster tier."""
        role, prefill = self.workers.role, self.prefill_workers
        if role == "prefill":
            raise ValueError("workers.role: prefill replicas go in a prefill_workers section beside workers "
                             "(which then decode)")
        if prefill is None:
            if role == "decode":
                raise ValueError("workers.role is decode but there is no prefill_workers section to compute "
                                 "the prompts: add one, or set workers.role to both")
            return self
        if role == "both":
            raise ValueError("workers.role is both but prefill_workers is set: beside prefill replicas, workers "
                             "decode (set workers.role to decode, or leave it out)")
        if prefill.role not in (None, "prefill"):
            raise ValueError(f"prefill_workers.role can only be prefill, got {prefill.role}")
        offload = self.engine_args().kv_offload
        if offload is None or offload.cluster_bytes == 0:
            raise ValueError("prefill_workers needs the cluster KV tier to hand prompts' KV to the decode replicas: "
                             "set engine.kv_offload.cluster_bytes")
        return self

    @property
    def worker_role(self) -> str:
        """What the ``workers`` replicas do: decode beside prefill replicas, else both."""
        return "decode" if self.prefill_workers is not None else "both"

    def engine_args(self, workers: WorkersSection | None = None) -> EngineArgs:
        """The engine of a replica of ``workers`` (default: the ``workers`` section; a prefill
        replica's differs only in its mesh)."""
        workers = workers or self.workers
        try:
            return EngineArgs(
                dtype=self.model.dtype,
                quantization=self.model.quantization,
                activation_quantization=self.model.activation_quantization,
                gguf_blocks=self.model.gguf_blocks,
                tensor_parallel_size=workers.tensor_parallel_size,
                expert_parallel_size=workers.expert_parallel_size,
                pipeline_parallel_size=workers.pipeline_parallel_size,
                pipeline_placement=workers.pipeline_placement,
                num_hosts=workers.num_hosts,
                **{**self.engine.model_dump(), "enable_lora": self.engine.enable_lora or bool(self.model.lora_modules)},
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"engine: {err}") from None

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.name


def parse_deploy_config(raw: Any, source: str = "deploy config") -> DeployConfig:
    """Validate a mapping (from YAML or Serve's ``args``) into a DeployConfig."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DeployConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return DeployConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        raise DeployConfigError(f"{source} is invalid:\n" + "\n".join(_describe(e) for e in err.errors())) from None


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Read and validate a deploy YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise DeployConfigError(f"cannot read deploy config {path}: {err.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise DeployConfigError(f"{path} is not valid YAML: {err}") from None
    return parse_deploy_config(raw, str(path))


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"  {where}: unknown key"
    message = error["msg"].removeprefix("Value error, ")
    return f"  {where}: {message} (got {error.get('input')!r})" if where != "(top level)" else f"  {message}"
