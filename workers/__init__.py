"""One model replica: scheduler, model runner, sampler, engine loop, and its Ray Serve deployment.

Usable without Ray: ``LLM`` for offline batches, ``AsyncEngine`` for streaming; both shaped
like vLLM's so moving over is an import change. The names load on first use (PEP 562), so
the router can import the wire types (``workers/replica_protocol.py``) without the engine.
"""

from __future__ import annotations

from model.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {  # module -> the names it defines
    "async_engine": ("AsyncEngine",),
    "engine": ("LLMEngine", "make_engine"),
    "engine_args": ("EngineArgs",),
    "llm": ("LLM",),
    "lora_manager": ("LoRARequest",),
    "outputs": ("CompletionOutput", "RequestOutput"),
    "sampling_params": ("SamplingParams", "SamplingParamsError"),
})
