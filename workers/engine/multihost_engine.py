"""One replica over several hosts: a leader engine that schedules, follower engines that do not.

Every host runs one process under ``jax.distributed`` (workers/engine/distributed_init.py),
and the mesh of ``tensor_parallel_size x expert_parallel_size`` devices takes every process's
devices. Each process builds the same engine from the same model and arguments, so the same
runner: the leader (``MultiHostEngine``) schedules and relays each launch
(workers/runner/multihost.py); a follower (``FollowerHost``) builds its engine with the
leader's pool sizes and then launches what the leader relays, reading nothing back. The
transport is the caller's: pipes (workers/engine/multihost_pipe.py) or Ray actor calls
(workers/serve/multihost_actors.py). Closing the leader's engine stops the followers' loops;
then every process calls ``leave_distributed``.

Weights: every process loads the whole checkpoint and ``jax.device_put`` keeps only its
addressable shards on its devices (loading by slice is issue 68's item 3).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable
from typing import Sequence as SequenceOf

import jax

from raylm.model.loaders.load import LoadedModel
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import LLMEngine
from raylm.workers.engine.progress import StderrProgress
from raylm.workers.runner.multihost import KvBlocks, LeaderRunner, Message, Relay, Stop, follow


def check_mesh_spans_hosts(args: EngineArgs) -> None:
    """The processes joined are the hosts asked for, and the mesh takes every device they have
    (a device left out of the mesh would leave its process with no shard to compute)."""
    if jax.process_count() != args.num_hosts:
        raise ValueError(f"num_hosts={args.num_hosts} but {jax.process_count()} process(es) joined jax.distributed; "
                         "call init_distributed in one process per host first")
    if jax.device_count() != args.num_devices:
        raise ValueError(f"tensor x expert parallel = {args.num_devices} devices, but the {args.num_hosts} hosts have "
                         f"{jax.device_count()}: the mesh must take every device of every host")


class MultiHostEngine(LLMEngine):
    """The leader: an ``LLMEngine`` whose runner relays every launch to the followers."""

    def __init__(self, model: LoadedModel, args: EngineArgs, relay: Relay,
                 progress: Callable[[Iterable], Iterable] = StderrProgress("compiling shape buckets"),
                 background_warmup: bool = False):
        check_mesh_spans_hosts(args)
        self.relay = relay
        self.runner_type = functools.partial(LeaderRunner, relay)
        super().__init__(model, args, progress, background_warmup)

    def _kv_block_counts(self, kv_dtype, draft_config) -> tuple[int, int | None]:
        counts = super()._kv_block_counts(kv_dtype, draft_config)
        self.relay.send(KvBlocks(counts))
        return counts

    def add_request(self, request_id: str, prompt: str | SequenceOf[int], params: SamplingParams,
                    priority: int = 0, embed: bool = False, lora_request: LoRARequest | None = None) -> None:
        """``LLMEngine.add_request``, refusing what a mesh over several hosts does not run: rows
        whose tokens need the host between steps, and embeddings (not tested across hosts)."""
        if params.structured_output is not None or params.logits_processors or embed:
            raise ValueError("structured output, logits processors and embeddings are not supported on a mesh "
                             f"over several hosts (num_hosts={self.args.num_hosts})")
        super().add_request(request_id, prompt, params, priority, embed, lora_request)

    def close(self) -> None:
        """Close the engine and let the followers leave their loops."""
        super().close()
        self.relay.send(Stop())


class _FollowerEngine(LLMEngine):
    """An engine built like the leader's, with the leader's pool sizes, that never schedules;
    its warm-up is the leader's, relayed."""

    def __init__(self, model: LoadedModel, args: EngineArgs, kv_blocks: tuple[int, int | None]):
        check_mesh_spans_hosts(args)
        self._leader_kv_blocks = kv_blocks
        super().__init__(model, dataclasses.replace(args, warmup=False), progress=lambda shapes: shapes)

    def _kv_block_counts(self, kv_dtype, draft_config) -> tuple[int, int | None]:
        return self._leader_kv_blocks


class FollowerHost:
    """A follower process's state: its engine, built on the leader's first message."""

    def __init__(self, model: LoadedModel, args: EngineArgs):
        self.model, self.args = model, args
        self.engine: LLMEngine | None = None

    def handle(self, message: Message) -> bool:
        """Apply one message from the leader; False once the leader has stopped."""
        if self.engine is None:
            if not isinstance(message, KvBlocks):
                raise TypeError(f"a follower's first message is the pool sizes, got {type(message).__name__}")
            self.engine = _FollowerEngine(self.model, self.args, message.counts)
            return True
        if not follow(self.engine.runner, message):
            self.engine.close()
            return False
        return True


def run_follower(model: LoadedModel, args: EngineArgs, receive: Callable[[], Message]) -> None:
    """A follower's loop: apply the leader's messages until it stops."""
    host = FollowerHost(model, args)
    while host.handle(receive()):
        pass
