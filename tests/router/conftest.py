"""Fixtures of the router tests."""

from __future__ import annotations

import pytest

from raylm.model.config.model_info import load_model_info
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The bundled model's tokenizer (what a router replica loads), once per session: reading it
    from the GGUF takes seconds."""
    return load_model_info(DEFAULT_MODEL).tokenizer
