"""One model replica: the engine core, the model runner, the engine loop, and its Ray Serve
deployment, one subpackage each (``core``, ``runner``, ``engine``, ``serve``), plus the wire
types the router shares (``wire``).

Usable without Ray: ``LLM`` for offline batches, ``AsyncEngine`` for streaming; both shaped
like vLLM's so moving over is an import change. Importing this package loads no JAX (the
router imports ``wire`` through it); building an engine does.
"""

from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import CompletionOutput, RequestOutput
from raylm.workers.core.sampling_params import SamplingParams, SamplingParamsError
from raylm.workers.engine.async_engine import AsyncEngine
from raylm.workers.engine.llm import LLM

__all__ = [
    "LLM", "AsyncEngine", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams", "SamplingParamsError",
]
