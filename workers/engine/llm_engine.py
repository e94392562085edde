"""The engine loop of one replica: add requests, step (schedule -> run -> process outputs), abort.

Synchronous and single-threaded on purpose; ``AsyncEngine`` drives it from a background
thread and ``LLM`` from a plain loop.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import random
import time
from typing import Callable, Iterable
from typing import Sequence as SequenceOf

import numpy as np

from raylm.cache.block_pool import NULL_BLOCK, BlockPool
from raylm.cache.block_tables import BlockManager
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.flop_count import ModelFlops
from raylm.model.decoder.kv_pool import kv_pool_dtype
from raylm.model.errors import PromptTooLongError
from raylm.model.loaders.load import LoadedModel, parse_dtype
from raylm.model.quantization.activations import with_int8_activations
from raylm.model.runtime.backend_support import check_fp8
from raylm.model.runtime.compilation_cache import enable_compilation_cache
from raylm.model.runtime.host_memory import release_freed_heap
from raylm.model.text.prompt_checks import check_prompt
from raylm.workers.core.embedding import EmbeddingState
from raylm.workers.core.engine_stats import EngineStats, LoraStats, MoeStats, remaining_work
from raylm.workers.core.grammar import GrammarCompiler
from raylm.workers.core.hidden_states import HiddenStateSlots, check_capture
from raylm.workers.core.lora_adapters import LoraAdapters, LoRARequest, LoraSlots
from raylm.workers.core.output_builder import stream_request_output
from raylm.workers.core.request import RequestState
from raylm.workers.core.request_output import RequestOutput
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.scheduler import Scheduler, SchedulerConfig
from raylm.workers.core.sequence import Sequence
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.kv_offload_setup import make_connector
from raylm.workers.engine.progress import StderrProgress
from raylm.workers.engine.runner_setup import build_runner, kv_block_counts
from raylm.workers.engine.step_work import StepCounters
from raylm.workers.pipeline.micro_batches import micro_batch_bounds
from raylm.workers.pipeline.pipeline_runner import PipelineRunner
from raylm.workers.pipeline.support import check_pipeline, largest_stage, last_stage_layers, stage_kv_group_layers
from raylm.workers.runner.draft_model import load_draft
from raylm.workers.runner.model_runner import ModelRunner
from raylm.workers.runner.pool_blocks import PoolBlocks

LOAD_WAIT_S = 0.01  # an engine with only loads in flight waits this long for one per step


class LLMEngine:
    """Continuous-batching engine over one model replica (possibly tensor-parallel)."""

    # What builds the runner: a multi-host leader's relays each launch to its followers first.
    runner_type: Callable[..., ModelRunner] = ModelRunner

    def __init__(
        self, model: LoadedModel, args: EngineArgs | None = None,
        progress: Callable[[Iterable], Iterable] = StderrProgress("compiling shape buckets"),
        background_warmup: bool = False,
    ):
        args = args if args is not None else EngineArgs()  # (not a default: building one starts JAX's backend)
        check_fp8(args.fp8_settings(model.quantization))
        float_model = model
        if args.quantization is not None:
            model = model.quantized(args.quantization)
        spec = args.speculative
        draft = load_draft(spec, model, float_model, args.dtype) if spec and spec.method == "draft" else None
        if model.activation_quantization not in ("none", args.activation_quantization):
            raise ValueError(f"model {model.name} is packed for activation_quantization {model.activation_quantization}; "
                             f"it cannot be served with activation_quantization {args.activation_quantization}")
        if args.activation_quantization == "int8" and model.activation_quantization == "none":
            # The target only (a draft keeps its exact sums); a model loaded for this engine came packed.
            model = dataclasses.replace(model, params=with_int8_activations(model.params, model.name),
                                        activation_quantization="int8")
        self.model = model
        self.args = args
        self.tokenizer = model.tokenizer
        self.max_model_len = args.resolve_max_model_len(model.config.max_position_embeddings)
        self.config = model.config.served_at(self.max_model_len)
        self.eos_ids = frozenset(self.config.eos_token_ids)
        if args.compilation_cache_dir:
            enable_compilation_cache(args.compilation_cache_dir)
        check_pipeline(args, self.config)
        kv_dtype = kv_pool_dtype(args.kv_cache_dtype, parse_dtype(args.dtype))
        num_blocks, sliding_blocks = self._kv_block_counts(kv_dtype, draft.config if draft else None)
        self.pool = BlockPool(num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching)
        # Interleaved sliding and full-attention layers: the sliding layers keep a KV group (block
        # tables, pool, device arrays) of their own, whose blocks go back behind the window.
        sliding = self.config.sliding_window
        self.blocks = BlockManager(
            self.pool, cache_salt=args.cache_salt(model.name, model.quantization),
            window=_kv_window([self.config.max_window] + ([draft.config.max_window] if draft else [])),
            sliding=None if sliding is None else (
                BlockPool(sliding_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching), sliding),
        )
        # What one sequence alone can ever hold (None: its windows bound it): fixed by the pools.
        self._pool_tokens = self.blocks.max_tokens(self._max_step_tokens())
        self.max_prompt_tokens = self.blocks.max_prompt_tokens(self._max_step_tokens())
        self.loras = LoraAdapters(self.config, args.max_lora_rank, args.max_cpu_loras or args.max_loras) \
            if args.enable_lora else None
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_args(args),
            self.blocks,
            self.eos_ids,
            HiddenStateSlots(args.hidden_state_slots),
            LoraSlots(args.max_loras, self.loras) if self.loras is not None else None,
        )
        self.draft_model = draft
        self.runner = build_runner(model, self.config, args, self.max_model_len, self.eos_ids,
                                   (num_blocks, sliding_blocks), kv_dtype, draft, self.runner_type)
        # Warm-up: every bucket now, or with ``background_warmup`` the ones a request alone takes now
        # and the rest later (a server that serves sooner: AsyncEngine compiles them beside the steps).
        self.warmup_pending: list[tuple[str, tuple[int, ...]]] = []
        if args.warmup:
            shapes = self.runner.warmup_shapes(args.num_scheduler_steps)
            now = shapes[: self.runner.first_warmup_shapes(args.num_scheduler_steps)] if background_warmup else shapes
            self.runner.warmup(args.num_scheduler_steps, now, progress, lora_slots=True)
            self.warmup_pending = shapes[len(now):]
        self.kv_connector, self.pool_blocks = None, None
        if args.kv_offload is not None:
            self._use_kv_offload(args, model, draft)
        self._limit_chunks_to_compiled()
        self.runner.take_expert_load()  # (the warm-up's tokens are not load)
        self.step_counters = StepCounters(
            args.block_size, self.runner.model_flops(self.config),
            ModelFlops.of(draft.config, draft.params) if draft else None,
            integer_matmuls=args.activation_quantization == "int8")
        # An MoE model's tokens routed per (sparse layer, expert), read from the device by ``stats``.
        self.routed_tokens = None if self.config.moe is None else np.zeros(
            (len(self.config.moe_layers), self.config.moe.num_experts), np.int64)
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_ids)
        self.requests: dict[str, RequestState] = {}
        self._seeds = random.Random(args.seed)
        self.num_requests = 0
        self.last_step_tokens = 0  # tokens the latest step computed (prefill chunks + decode steps)
        self.in_flight: collections.deque = collections.deque()  # (plan, runner's pending step, planned at)

    def _use_kv_offload(self, args: EngineArgs, model: LoadedModel, draft: LoadedModel | None) -> None:
        """Keep blocks beyond the pool in the tiers ``args.kv_offload`` turns on (cache/offload/)."""
        self.pool_blocks = PoolBlocks(self.runner)
        if args.warmup:
            self.pool_blocks.warm_up()
        self.kv_connector = make_connector(
            args.kv_offload, self.pool_blocks, self.blocks.salt, (model.params, draft.params if draft else None),
            args.num_devices, self.runner.cpu_kernels)
        self.blocks.record_commits = True
        self.scheduler.use_kv_offload(self.kv_connector)

    def _kv_block_counts(self, kv_dtype, draft_config: ModelConfig | None) -> tuple[int, int | None]:
        """The pool's blocks and the sliding group's (``kv_block_counts``), for the largest stage
        (with two groups, a budget that fits every stage)."""
        pp = self.args.pipeline_parallel_size
        return kv_block_counts(largest_stage(self.config, pp), self.args, kv_dtype, draft_config,
                               self._max_step_tokens(prompts=False), stage_kv_group_layers(self.config, pp))

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceOf[int],
        params: SamplingParams,
        priority: int = 0,
        embed: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises ValueError (e.g. PromptTooLongError) if it can never run.
        ``embed``: the request wants its prompt's embedding (``RequestOutput.embedding``, pooled
        as ``EngineArgs.embedding_pooling`` says) instead of a completion; ``params`` must ask
        for one sequence. ``lora_request``: generate with that LoRA adapter (read now if it is
        not in host memory: one that cannot be served raises ``LoraAdapterError``)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if self.loras is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked of a replica without LoRA; "
                                 "start it with enable_lora=True")
            self.loras.add(lora_request)
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(prompt_ids, params)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        if embed and (params.n != 1 or params.structured_output is not None):
            raise ValueError("an embedding request takes one sequence and no structured output")
        if params.logits_processors and (embed or self.args.speculative is not None):
            raise ValueError("logits_processors do not combine with speculative decoding or embeddings")
        hidden = None
        if params.return_hidden_states is not None:
            if params.n != 1 or embed:
                raise ValueError("return_hidden_states takes one sequence (n = 1) and no embedding")
            hidden = check_capture(
                params.return_hidden_states, self.config.num_layers, len(prompt_ids), max_tokens,
                params.hidden_states_include_prompt, self.args.hidden_state_slots, self.args.hidden_state_max_tokens,
            )
        seqs = [
            Sequence.create(
                request_id, i, prompt_ids, params, (base_seed + i * 1_000_003) % 2**32, max_tokens, priority,
                self.tokenizer,
                # each sequence follows the grammar on its own
                matcher=self.grammars.matcher(params.structured_output) if params.structured_output else None,
                embedding=EmbeddingState(self.args.embedding_pooling) if embed else None, hidden=hidden,
                lora=lora_request,
            )
            for i in range(params.n)
        ]
        self.requests[request_id] = RequestState(request_id, text, prompt_ids, seqs, time.monotonic())
        self.scheduler.add(seqs[0], forks=seqs[1:])
        self.num_requests += 1

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """Outputs a sequence may generate: what was asked for (else up to the context), but no
        more than one sequence can hold in the whole KV pool. Beyond that it could never get
        another block, even alone, and would wait for one forever; it ends with "length" there.
        The last sampled token is never fed back, so it needs no K/V (hence the + 1). A KV
        group whose layers all slide holds a bounded number of blocks of a sequence however
        long it grows: when every group does, only the context limits it."""
        asked = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        if self._pool_tokens is None:
            return asked  # its windows bound what it holds: the pools never run out for it alone
        return min(asked, self._pool_tokens + 1 - prompt_len)

    def _max_step_tokens(self, prompts: bool = True) -> int:
        """The most tokens of one sequence a step computes: a prompt chunk (the token budget;
        not with ``prompts=False``), the decode steps of one call, or a speculative step's last
        token and guesses."""
        spec = self.args.speculative
        return max(self.args.max_num_batched_tokens if prompts else 1, self.args.num_scheduler_steps,
                   1 + (spec.num_speculative_tokens if spec else 0))

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        check_prompt(prompt_ids, self.config.vocab_size, params.max_tokens or 1, self.max_model_len)
        bad_bias = [t for t in params.logit_bias or {} if t >= self.config.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if not self.args.enable_chunked_prefill and n > self.args.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt has {n} tokens but max_num_batched_tokens is {self.args.max_num_batched_tokens} and "
                "chunked prefill is off; enable chunked prefill or raise the budget"
            )
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt has {n} tokens but the KV pool holds prompts of at most {self.max_prompt_tokens} tokens"
            )

    def warm_up_next(self) -> None:
        """Compile the next program ``background_warmup`` left (a fraction of a second)."""
        self.runner.warmup(self.args.num_scheduler_steps, self.warmup_pending[:1])
        self.compiled(self.warmup_pending[0])

    def compiled(self, shape: tuple[str, tuple[int, ...]]) -> None:
        """``shape``'s program is compiled (here, or by ``AsyncEngine``'s compile thread): steps may launch it."""
        self.warmup_pending = [pending for pending in self.warmup_pending if pending != shape]
        self._limit_chunks_to_compiled()

    def end_warmup(self) -> None:
        """Drop the background warm-up: what it left compiles on first use, and prompt chunks
        are no longer held to the compiled buckets."""
        self.warmup_pending.clear()
        self._limit_chunks_to_compiled()

    @property
    def chunks_wait_for_compile(self) -> bool:
        """Whether the last step held a prompt chunk to the compiled buckets: the caller should
        compile the next one (``warm_up_next``) even while requests run, or under steady load
        long prompts would stay in small chunks."""
        return self.scheduler.chunk_capped and self.scheduler.chunk_cap is not None

    def _limit_chunks_to_compiled(self) -> None:
        """Hold prompt chunks to the packed buckets compiled so far, while others wait in the
        background warm-up (``warmup_shapes`` orders them: the larger ones ascending, then the
        smaller): a restarted replica serves a long prompt in chunks at once, and a short one
        padded to a compiled bucket, rather than stalling every request for a compile. Without
        chunked prefill a prompt cannot be split, so its bucket compiles on first use as before."""
        waiting = frozenset(dims[0] for kind, dims in self.warmup_pending if kind == "packed")
        if not self.args.enable_chunked_prefill:
            waiting = frozenset()
        self.runner.packed_unavailable = waiting
        # The largest compiled bucket (the first one and those compiled above it, in order).
        self.scheduler.chunk_cap = self.runner.buckets.largest_token_bucket(waiting) if waiting else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output, if it existed."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.finished:
                self.scheduler.abort(seq)
        return stream_request_output(state, final=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.in_flight)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round: plan and start steps while the runner takes more (one; a pipeline one per
        stage: micro-batches, each stage computing one while the next computes the one before),
        then finish the oldest; returns the outputs of requests that made progress."""
        self.last_step_tokens = 0
        while len(self.in_flight) < self.runner.max_in_flight:
            plan = self.scheduler.schedule(*micro_batch_bounds(self.scheduler, self.in_flight, self.runner.max_in_flight))
            if plan.kv_writes:
                self.pool_blocks.write(plan.kv_writes)
            if plan.sliding_kv_writes:
                self.pool_blocks.write(plan.sliding_kv_writes, group=1)
            if plan.empty:
                break
            # Before submit: a replica's runner computes the step in it (step seconds, queue time).
            started = time.monotonic()
            self.in_flight.append((plan, self.runner.submit(plan), started))
        if not self.in_flight:
            if self.scheduler.num_loading:  # nothing to compute until a load ends: wait for one, not spin
                self.kv_connector.wait(LOAD_WAIT_S)
            return []
        plan, pending, scheduled_at = self.in_flight.popleft()
        self.last_step_tokens = plan.num_tokens
        output = self.runner.finish(pending)
        self.step_counters.add(plan, output, time.monotonic() - scheduled_at)
        progressed = self.scheduler.update_from_output(plan, output, scheduled_at)
        if self.kv_connector is not None:
            self._publish_blocks()
        for seq in progressed:  # finished captures: read before the next step reuses their slot
            if seq.finished and seq.hidden is not None:
                self.requests[seq.request_id].hidden_states = self.runner.read_hidden_states(seq.hidden, seq.num_tokens)

        outputs = []
        for state in {seq.request_id: self.requests[seq.request_id] for seq in progressed}.values():
            outputs.append(stream_request_output(state, final=state.finished))
            if state.finished:
                del self.requests[state.request_id]
        outputs += self._abort_failed_processors(output.processor_failures)
        return outputs

    def _publish_blocks(self) -> None:
        """Offer the blocks this step filled to the offload tiers, read before the next step can
        reuse them (a finished sequence's blocks are free, but unchanged until reallocated)."""
        committed = self.blocks.take_committed()
        for group in range(self.pool_blocks.num_groups) if committed else ():
            pairs = [(block, h) for g, block, h in committed if g == group]
            wanted = [pair for pair, new in zip(pairs, self.kv_connector.wants([h for _, h in pairs], group)) if new]
            if wanted:
                self.kv_connector.publish([h for _, h in wanted], self.pool_blocks.read([b for b, _ in wanted], group),
                                          group)

    def flush_kv_publish(self, timeout: float) -> None:
        """Wait until every block published so far is in every offload tier (thread-safe: touches
        only the connector); nothing to wait for without offload."""
        if self.kv_connector is not None:
            self.kv_connector.flush(timeout)

    def refresh_kv_tiers(self, timeout: float) -> None:
        """Let the tiers see what other replicas stored until now (the cluster tier's directory
        mirror), e.g. before admitting a request whose prompt another replica just computed."""
        for tier in self.kv_connector.tiers if self.kv_connector is not None else ():
            refresh = getattr(tier, "refresh", None)
            if refresh is not None:
                refresh(timeout)

    def close(self) -> None:
        """Stop the offload tiers' threads (what they stored stays where it lives) and the
        pipeline's stage actors."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if isinstance(self.runner, PipelineRunner):
            self.runner.close()

    def _abort_failed_processors(self, failed: dict[int, str]) -> list[RequestOutput]:
        """Requests whose logits processor failed this step end now ("abort"; it was logged)."""
        if not failed:
            return []
        ended = [self.abort(state.request_id) for state in list(self.requests.values())
                 if any(seq.seq_id in failed for seq in state.seqs)]
        return [out for out in ended if out is not None]

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Queue, pool and token counters: what metrics, routing, autoscaling and status read."""
        scheduler = self.scheduler
        spec = scheduler.spec_stats if self.args.speculative is not None else None
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            waiting_tokens=sum(len(s.prompt_ids) + len(s.output_ids) for s in scheduler.waiting),
            work_tokens=sum(remaining_work(s) for s in (*scheduler.running, *scheduler.waiting)),
            tokens_stored=sum(s.num_computed_tokens - s.block_ids.count(NULL_BLOCK) * self.pool.block_size
                              for s in scheduler.running),
            token_capacity=self.pool.num_used_blocks * self.pool.block_size,
            num_preemptions=scheduler.num_preemptions,
            requests=self.num_requests,
            prompt_tokens=scheduler.num_prompt_tokens,
            generation_tokens=scheduler.num_generated_tokens,
            pool=self.pool.stats(),
            spec=copy.deepcopy(spec),
            lora=self._lora_stats(),
            moe=self._moe_stats(),
            max_prompt_tokens=self.max_prompt_tokens,
            warmup_programs_left=len(self.warmup_pending),
            compute=self.step_counters.stats(),
            loading=scheduler.num_loading,
            kv_offload=tuple(self.kv_connector.stats()) if self.kv_connector is not None else None,
            **({"kv_offload_queried_tokens": scheduler.loads.num_queried_tokens,
                "kv_offload_loaded_tokens": scheduler.loads.num_loaded_tokens} if scheduler.loads is not None else {}),
        )

    def _moe_stats(self) -> MoeStats | None:
        load = self.runner.take_expert_load()
        if load is None:
            return None
        self.routed_tokens += load
        return MoeStats(self.args.expert_parallel_size, self.args.tensor_parallel_size, self.config.moe.num_experts,
                        self.config.moe_layers, tuple(tuple(int(n) for n in layer) for layer in self.routed_tokens))

    def _lora_stats(self) -> LoraStats | None:
        slots = self.scheduler.lora_slots
        if slots is None:
            return None
        return LoraStats(tuple(slots.resident), slots.num_in_use, dict(slots.loads), dict(slots.evictions))


def _kv_window(windows: list[int | None]) -> int | None:
    """The window of the models sharing the block tables (the model and any draft model) that
    lets blocks go: every layer of every one of them must slide (the widest window counts)."""
    return None if None in windows else max(windows)  # type: ignore[type-var]


def make_engine(model: str | LoadedModel, background_warmup: bool = False, **engine_args) -> LLMEngine:
    """Load ``model`` (name, path or LoadedModel) and build an engine with ``engine_args``."""
    from raylm.workers.engine.replica_model import load_replica_model

    args = EngineArgs.from_kwargs(**engine_args)
    if args.num_hosts > 1:
        raise ValueError(f"num_hosts={args.num_hosts}: every host's process builds a MultiHostEngine "
                         "(workers/engine/multihost_engine.py), or serve it with raylm serve")
    if not isinstance(model, LoadedModel):
        # With pipeline stages this process is the last and reads that stage's layers alone.
        layers = None if args.pipeline_parallel_size == 1 else last_stage_layers(model, args.pipeline_parallel_size)
        model = load_replica_model(model, args, layers=layers)
    engine = LLMEngine(model, args, background_warmup=background_warmup)
    del model  # the stored form the engine replaced (a quantized or packed copy) goes before the heap is trimmed
    release_freed_heap()
    return engine

