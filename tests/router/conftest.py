"""Fixtures of the router tests."""

from __future__ import annotations

import pytest

from model import DEFAULT_MODEL, Tokenizer, load_model_info


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The bundled model's tokenizer (what a router replica loads), once per session: reading it
    from the GGUF takes seconds."""
    return load_model_info(DEFAULT_MODEL).tokenizer
