"""Offline batch inference, shaped like vLLM's ``LLM`` so switching is an import change."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import CompletionOutput, RequestOutput
from raylm.workers.core.sampling_params import BeamSearchParams, SamplingParams
from raylm.workers.engine.beam_search import BeamSearch

if TYPE_CHECKING:
    from raylm.model.loaders.load import LoadedModel
    from raylm.model.text.tokenizer import Tokenizer

PromptInput = Union[str, Mapping[str, Any]]
Messages = Sequence[Mapping[str, Any]]


class LLM:
    """``LLM(model=..., dtype=..., **engine_args)``; ``generate`` and ``chat`` run to completion."""

    def __init__(self, model: str | LoadedModel, dtype: str = "float32", **engine_args: Any):
        from raylm.workers.engine.llm_engine import make_engine  # JAX: loaded when an engine is built

        self.engine = make_engine(model, dtype=dtype, **engine_args)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's background work: the KV offload tiers' threads (what they stored stays
        where it lives) and a pipeline's stage actors. Call it, or use ``with LLM(...) as llm``,
        before ``ray.shutdown`` in a process that goes on."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (strings or ``{"prompt_token_ids": [...]}``); results in input order.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs ``enable_lora=True``."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, _prompt_of(prompt), p, priority[i] if priority else 0,
                                    lora_request=loras[i])
            ids.append(request_id)
        return self._run(ids)

    def embed(self, prompts: PromptInput | Sequence[PromptInput]) -> list[list[float]]:
        """The normalised embedding of every prompt (pooled as ``embedding_pooling`` says), in
        input order; batched with each other like any prompts."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        ids = []
        for prompt in prompts:
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, _prompt_of(prompt), SamplingParams(max_tokens=1), embed=True)
            ids.append(request_id)
        return [out.embedding for out in self._run(ids)]

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[list[CompletionOutput]]:
        """The ``beam_width`` best continuations of every prompt by beam search (best first;
        ``cumulative_logprob`` is the beam's), with ``lora_request``'s adapter. Each step runs
        every live beam of every prompt as one batch of one-token requests; the prefix cache
        shares what beams have in common."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompt_ids = [self._token_ids(p) for p in prompts]
        searches = [BeamSearch(params, self.engine.eos_ids) for _ in prompt_ids]
        step = params.step_params()
        while not all(s.done for s in searches):
            ids = {}
            for i, (prompt, search) in enumerate(zip(prompt_ids, searches)):
                for j, beam in enumerate(search.live):
                    request_id = f"beam-{next(self._ids)}"
                    self.engine.add_request(request_id, prompt + list(beam.tokens), step, lora_request=lora_request)
                    ids[request_id] = (i, j)
            outputs = self._run(list(ids))
            candidates: list[list[dict[int, float]]] = [[{} for _ in s.live] for s in searches]
            for out in outputs:
                i, j = ids[out.request_id]
                candidates[i][j] = out.outputs[0].logprobs[0]
            for search, found in zip(searches, candidates):
                if not search.done:
                    search.advance(found)
        return [s.outputs(self.engine.tokenizer) for s in searches]

    def _token_ids(self, prompt: PromptInput) -> list[int]:
        value = _prompt_of(prompt)
        return self.engine.tokenizer.encode_prompt(value) if isinstance(value, str) else value

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            {"prompt_token_ids": tokenizer.encode_chat(c, add_generation_prompt)} for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for request_id in pending:
                self.engine.abort(request_id)
        return [final[r] for r in request_ids]


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
