"""fp8 settings on a backend that cannot run 8-bit floats stop the engine at start-up with the
settings' names; on one that can (CPU) they pass.

No backend without fp8 is at hand, so the probe is made to fail the two ways a backend fails
it: compiling raises (no lowering), or the values come back wrong."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.model.runtime import backend_support
from raylm.workers.engine.llm import LLM


@pytest.fixture
def backend_without_fp8(monkeypatch):
    """The probe as a backend without an fp8 lowering answers it."""

    def no_lowering(x, device):
        raise RuntimeError("UNIMPLEMENTED: no lowering for f8E4M3FN convert\n(more XLA detail)")

    backend_support._fp8_problem.cache_clear()
    monkeypatch.setattr(backend_support, "_probe", no_lowering)
    yield
    backend_support._fp8_problem.cache_clear()


def test_this_backend_runs_fp8_and_nothing_is_checked_without_fp8_settings():
    backend_support._fp8_problem.cache_clear()
    backend_support.check_fp8(["model.quantization: fp8"])
    backend_support.check_fp8([])


def test_a_failing_compile_names_the_settings_the_backend_and_the_cause(backend_without_fp8):
    with pytest.raises(ValueError) as error:
        backend_support.check_fp8(["model.quantization: fp8", "engine.kv_cache_dtype: fp8"])
    message = str(error.value)
    assert message.startswith("model.quantization: fp8 and engine.kv_cache_dtype: fp8: this backend (cpu, ")
    assert "no lowering for f8E4M3FN convert" in message and "more XLA detail" not in message
    assert "Use int8" in message


def test_wrong_values_are_refused_too(monkeypatch):
    backend_support._fp8_problem.cache_clear()
    monkeypatch.setattr(backend_support, "_probe", lambda x, device: np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn values come back wrong"):
        backend_support.check_fp8(["engine.kv_cache_dtype: fp8"])
    backend_support._fp8_problem.cache_clear()


@pytest.mark.parametrize("engine_args, setting", [
    ({"quantization": "fp8"}, "model.quantization: fp8"),
    ({"kv_cache_dtype": "fp8"}, "engine.kv_cache_dtype: fp8"),
    ({"speculative": {"method": "draft", "num_layers": 1, "quantization": "fp8"}},
     "engine.speculative.quantization: fp8"),
])
def test_the_engine_refuses_each_fp8_setting_at_start_up(tiny_gqa_model, backend_without_fp8, engine_args, setting):
    with pytest.raises(ValueError, match=f"^{setting}: this backend"):
        LLM(tiny_gqa_model, num_kv_blocks=16, **engine_args)


def test_the_engine_starts_with_int8_on_that_backend(tiny_gqa_model, backend_without_fp8):
    LLM(tiny_gqa_model, num_kv_blocks=16, quantization="int8", kv_cache_dtype="int8")
