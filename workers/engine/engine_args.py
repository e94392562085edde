"""Engine settings (the knobs a user passes to ``LLM(...)`` or the deploy YAML), validated."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from raylm.cache.block_hash import model_salt
from raylm.cache.offload.config import KVOffloadConfig
from raylm.model.decoder.kv_pool import DEFAULT_BLOCK_SIZE, kv_pool_dtype
from raylm.model.loaders.load import keep_gguf_blocks
from raylm.model.quantization.activations import parse_activation_quantization
from raylm.model.quantization.quant_array import parse_quantization
from raylm.workers.core.embedding import EmbeddingState
from raylm.workers.core.speculation import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 4096
LORA_DTYPES = (None, "float32", "bfloat16", "int8")  # the LoRA slots' type (None: the model's)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes one model replica besides the model itself."""

    dtype: str = "float32"
    # Weight-only int8 / fp8 (model/quantization/quant_array.py); None: as loaded (a model given already
    # quantized stays so), "none": float weights.
    quantization: str | None = None
    # A GGUF's block-quantized matrices: kept as stored (exact), or expanded to float32
    # (model/loaders/load.py's keep_gguf_blocks; "auto": kept on one CPU device in float32).
    gguf_blocks: str = "auto"
    # The integer compute mode (model/quantization/activations.py): "int8" quantizes activations
    # per block of 32 and sums in integers against GGUF block and int8 weights; "none": exact.
    activation_quantization: str = "none"
    kv_cache_dtype: str | None = None  # auto (None): the model dtype; int8 / fp8: 8-bit with scales
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # exact pool size; else sized from the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU budget (default 2 GiB) / explicit budget
    kv_cache_memory_fraction: float = 0.8  # of free device memory, on accelerators
    max_model_len: int | None = None  # default: min(model context, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # devices a mixture-of-experts model's experts are split over
    # Processes (one per host) the tensor x expert mesh spans, under jax.distributed: the first
    # schedules and every other follows its plans (workers/engine/multihost_engine.py).
    num_hosts: int = 1
    seed: int = 0  # seeds the per-request seeds of requests that give none
    warmup: bool = False  # compile every shape bucket at start-up
    compilation_cache_dir: str | None = None  # persistent XLA cache (the CLI uses ~/.cache/raylm/jax)
    # Speculative decoding (workers/core/speculation.py); a mapping is accepted and parsed.
    speculative: SpeculativeConfig | None = None
    embedding_pooling: str = "mean"  # embedding requests: "mean" of the prompt's hidden states, or "last"
    # Hidden-state extraction (workers/core/hidden_states.py): requests served at once (0: off) and
    # positions each may capture; the buffers take slots x (layers + 1) x tokens x hidden x 4 bytes.
    hidden_state_slots: int = 0
    hidden_state_max_tokens: int = 1024
    # LoRA adapters (workers/core/lora_adapters.py): requests may name one; max_loras of them sit in
    # device slots at once (a batch mixes them), each of rank up to max_lora_rank; host memory
    # keeps max_cpu_loras (default: max_loras) read adapters. lora_dtype: the slots' type (None:
    # the model's); "bfloat16" on a float32 model halves the bytes each decode step reads for its
    # adapters, which are then rounded to bfloat16, "int8" quarters them, each A row and B output
    # scaled to int8 (CPU replicas, model/kernels/lora_delta.py).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str | None = None
    # KV blocks beyond the pool (cache/offload/): host memory, local disk and the cluster's object
    # store, each sized in bytes; a mapping is accepted and parsed. None: off.
    kv_offload: KVOffloadConfig | None = None
    # Pipeline parallelism (workers/pipeline/): the decoder's layers split into this many stages,
    # each with its layers' weights and KV pool; the last runs in the engine's process, the others
    # as Ray actors placed one a node where the cluster allows ("spread"), packed onto as few
    # nodes as they fit ("pack"), or all in this process ("local": one machine, no Ray).
    pipeline_parallel_size: int = 1
    pipeline_placement: str = "spread"
    # Attention on a GPU: a Pallas (Triton) paged kernel reading the pool in place
    # (model/kernels/pallas/paged_attention.py), or "jnp", the portable gather path (a way back
    # should a GPU's Triton build fail). Ignored elsewhere.
    gpu_attention: str = "pallas"

    def keep_gguf_blocks(self) -> bool:
        """Whether this replica loads a GGUF's block matrices as stored."""
        return keep_gguf_blocks(self.gguf_blocks, self.dtype, self.num_devices)

    @property
    def num_devices(self) -> int:
        """Devices one replica spans: tensor x expert parallel."""
        return self.tensor_parallel_size * self.expert_parallel_size

    def fp8_settings(self, loaded_quantization: str | None) -> list[str]:
        """The settings (with the model's own quantization, as loaded) that store 8-bit floats."""
        settings = []
        if self.quantization == "fp8" or (self.quantization is None and loaded_quantization == "fp8"):
            settings.append("model.quantization: fp8")
        if self.kv_cache_dtype == "fp8":
            settings.append("engine.kv_cache_dtype: fp8")
        if self.speculative is not None and self.speculative.quantization == "fp8":
            settings.append("engine.speculative.quantization: fp8")
        return settings

    def cache_salt(self, model_name: str, loaded_quantization: str | None = None) -> str:
        """The salt of the served model's block hashes, derived here only: the replica's
        prefix cache and the router's prefix hashing must agree on it. ``loaded_quantization``:
        the model's own, for an engine given a model already quantized (quantization None)."""
        quantization = self.quantization if self.quantization is not None else loaded_quantization
        computed = quantization or "none"
        if self.activation_quantization != "none":  # other arithmetic, other K/V
            computed = f"{computed}:activations-{self.activation_quantization}"
        return model_salt(model_name, self.dtype, computed)

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """The context a replica serves: ``max_model_len`` capped by the model's positions."""
        return min(max_position_embeddings, self.max_model_len or DEFAULT_MAX_MODEL_LEN)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        object.__setattr__(self, "kv_offload", KVOffloadConfig.parse(self.kv_offload))
        if self.kv_offload is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload stores and finds blocks by their prefix hashes: it needs "
                             "enable_prefix_caching; turn it on or remove kv_offload")
        if self.speculative is not None and self.num_scheduler_steps > 1:
            raise ValueError("speculative decoding already emits several tokens per step: it cannot be combined "
                             f"with num_scheduler_steps={self.num_scheduler_steps}; set num_scheduler_steps to 1")
        kv_pool_dtype(self.kv_cache_dtype, jnp.float32)  # raises, naming the choices, on an unknown name
        parse_quantization(self.quantization)  # likewise
        object.__setattr__(self, "activation_quantization", parse_activation_quantization(self.activation_quantization))
        if self.activation_quantization != "none" and self.num_devices > 1:
            raise ValueError(f"activation_quantization {self.activation_quantization} runs a CPU kernel on one device; "
                             f"got {self.num_devices} (tensor x expert parallel): serve one device, or set "
                             "activation_quantization none")
        if self.activation_quantization != "none" and self.quantization == "fp8":
            raise ValueError(f"activation_quantization {self.activation_quantization} computes GGUF block and int8 "
                             "weights in integers, not fp8 ones: set quantization int8 or int8_g32, or "
                             "activation_quantization none")
        keep_gguf_blocks(self.gguf_blocks, self.dtype, self.num_devices)  # likewise, and an impossible keep
        EmbeddingState(self.embedding_pooling)  # likewise
        if not (isinstance(self.hidden_state_slots, int) and self.hidden_state_slots >= 0):
            raise ValueError(f"hidden_state_slots must be an integer >= 0, got {self.hidden_state_slots!r}")
        if not (isinstance(self.hidden_state_max_tokens, int) and self.hidden_state_max_tokens >= 1):
            raise ValueError(f"hidden_state_max_tokens must be an integer >= 1, got {self.hidden_state_max_tokens!r}")
        if self.hidden_state_slots and self.speculative is not None:
            raise ValueError("hidden-state extraction does not combine with speculative decoding; "
                             "set hidden_state_slots to 0 or remove speculative")
        for name in ("max_loras", "max_lora_rank"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES} (None: the model's dtype), got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and not (
                isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if not (isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1):
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.gpu_attention not in ("pallas", "jnp"):  # (workers/runner/platform_kernels.py)
            raise ValueError(f"gpu_attention must be pallas or jnp, got {self.gpu_attention!r}")
        if self.pipeline_placement not in ("spread", "pack", "local"):  # (workers/pipeline/support.py)
            raise ValueError(f"pipeline_placement must be spread, pack or local, got {self.pipeline_placement!r}")
        if self.pipeline_parallel_size > 1 and self.num_hosts > 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} with num_hosts={self.num_hosts}: "
                             "pipeline stages over a mesh that spans hosts are not supported; use one of them")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        self._check_multihost()

    def _check_multihost(self) -> None:
        """A mesh over several hosts runs the plain steps only: the features whose programs read
        host state the followers do not have (or that were not tested across hosts) are refused."""
        if not (isinstance(self.num_hosts, int) and self.num_hosts >= 1):
            raise ValueError(f"num_hosts must be an integer >= 1, got {self.num_hosts!r}")
        if self.num_hosts == 1:
            return
        if self.num_devices % self.num_hosts:
            raise ValueError(f"num_hosts={self.num_hosts} must divide tensor x expert parallel = {self.num_devices} "
                             "(each host gives the mesh the same number of devices)")
        refused = {"speculative": self.speculative is not None, "kv_offload": self.kv_offload is not None,
                   "enable_lora": self.enable_lora, "hidden_state_slots": self.hidden_state_slots > 0}
        named = [name for name, on in refused.items() if on]
        if named:
            raise ValueError(f"num_hosts={self.num_hosts}: a mesh over several hosts does not support "
                             f"{', '.join(named)} yet; turn them off or serve on one host")
