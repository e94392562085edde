"""One model replica: scheduler, model runner, sampler, engine loop, and its Ray Serve deployment.

Usable without Ray: ``LLM`` for offline batches, ``AsyncEngine`` for streaming; both shaped
like vLLM's so moving over is an import change.
"""

from workers.async_engine import AsyncEngine
from workers.engine import LLMEngine, make_engine
from workers.engine_args import EngineArgs
from workers.llm import LLM
from workers.outputs import CompletionOutput, RequestOutput
from workers.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineArgs", "LLM", "LLMEngine", "RequestOutput", "SamplingParams",
    "SamplingParamsError", "make_engine",
]
