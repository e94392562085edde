"""The router's knobs, filled in from the deploy YAML's ``router`` and ``model`` sections."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """What the ingress needs to parse, validate and forward requests for one model."""

    model: str  # registry name or path: the router loads its tokenizer and config, not its weights
    served_model_name: str  # the name clients send as ``model``
    max_model_len: int  # must equal the workers' (both come from the same engine args)
    max_request_bytes: int = 1 << 20
    health_check_timeout_s: float = 10.0
