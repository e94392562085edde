"""Unoptimized test programs compile through XLA's CPU loop emitters, about twice as fast.

The suite compiles its programs without LLVM's optimization passes (``jax_disable_most_optimizations``,
tests/conftest.py), and what remains of XLA's CPU backend compile is mostly its newer fusion
emitters' code generation. With ``xla_cpu_use_fusion_emitters`` off the same HLO is lowered by the
older per-op loop emitters: the same programs, compiled ~2x faster (a tiny engine's 13 programs
6-12 s -> 3.4-7.7 s, same tokens; the interpreted Pallas MoE engine test 44 s -> 14-18 s of
compile). Results agree within float rounding, not always bit for bit (``fusion_emitters``). Optimized
programs (the ``optimized_xla`` modules) keep the default: there the old emitters compiled a
bundled-model engine's programs 3x slower.

``jax.jit`` takes per-function ``compiler_options``, but the programs are the engine's own; this
adds the option to every compile of the test process through JAX's ``get_compile_options``, the
function whose ``env_option_overrides`` those ``compiler_options`` fill. It is JAX's internal API:
where a JAX release moves it, the suite runs as before, only slower.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax

OPTION = ("xla_cpu_use_fusion_emitters", False)
_loop_emitters = [True]  # off inside ``with fusion_emitters()``


def compile_unoptimized_programs_faster() -> bool:
    """Install the option for every compile while ``jax_disable_most_optimizations`` is on;
    whether this JAX has the hook."""
    try:
        from jax._src import compiler
    except ImportError:
        return False
    original = getattr(compiler, "get_compile_options", None)
    if original is None or getattr(original, "_adds_loop_emitters", False):
        return original is not None

    def get_compile_options(*args: Any, **kwargs: Any) -> Any:
        options = original(*args, **kwargs)
        if _loop_emitters[0] and jax.config.read("jax_disable_most_optimizations"):
            options.env_option_overrides = [*options.env_option_overrides, OPTION]
        return options

    get_compile_options._adds_loop_emitters = True
    compiler.get_compile_options = get_compile_options
    return True


@contextlib.contextmanager
def fusion_emitters() -> Iterator[None]:
    """Programs compiled inside use XLA's default (fusion) emitters, as served programs do: for a
    test that asserts two programs' floats equal bit for bit. The two emitters lower a reduction
    in different orders, and which order two different programs share is the default emitters'
    property (a Q4_K_M model kept as blocks and expanded to float32 gave the same logprobs with
    them, not with the loop emitters)."""
    _loop_emitters[0] = False
    try:
        yield
    finally:
        _loop_emitters[0] = True
