"""Shared fixtures. Two host devices are forced before JAX starts so TP=2 runs on CPU."""

from __future__ import annotations

import gc
import os
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Most of the in-process tests' time was XLA's CPU backend optimizing programs that then run for
# milliseconds (a bundled-model program ~7 s to compile; a tiny engine's 90 programs 26 s of a
# 32 s test). They compile without LLVM's optimization passes (XLA's backend level 0): the same
# HLO, dots and C++ kernels; an engine and its reference share the setting. Measured on 6 engine
# tests: 253 s -> 91 s. Only this process: the Ray replicas and `raylm serve` processes the tests
# start serve fully optimized (their programs come from the persistent compilation cache, and
# run ~1.5x slower unoptimized). JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the tests optimized too.
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
    jax.config.update("jax_disable_most_optimizations", True)
    from tests.fast_compile import compile_unoptimized_programs_faster  # noqa: E402

    compile_unoptimized_programs_faster()

# CI replays the same examples every run (a red CI must be reproducible); locally
# hypothesis keeps exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from raylm.model.config.registry import DEFAULT_MODEL, resolve_model_path
from raylm.model.loaders.load import LoadedModel, load_model
from tests import worker_time

# Tests that start or use the session's Ray cluster: under pytest-xdist they all run on one worker
# (one session cluster, and two of its tests never compete for the two cores' processes).
RAY_FIXTURES = frozenset({"serve_cluster", "raylm_app"})
RAY_PATHS = ("tests/cluster/",)

# Tests that start a Ray cluster of their own in a subprocess, which neither finds nor is found by
# the session's: the scenarios (a private RAY_TMPDIR / --temp-dir; GCS, agent and Serve ports of
# their own) and ``raylm serve`` on a local cluster of its own (a fresh ``ray.init``: a new session
# dir and ports; only ``ray start`` leaves an address for a later ``ray.init`` to join). In the
# session cluster's group, the suite's longest, they added ~6 min to it one after another: they are
# groups of their own (their module's tests that use the session's cluster excepted), queued last,
# so whichever worker is free first at the end takes them, the session cluster's included; the
# longest first (their seconds in a fresh-clone ``make test``: 80, 38 + 45, 64, 53, 37, 14).
PRIVATE_CLUSTER_PATHS = (
    "tests/cluster/test_pipeline_multinode.py",
    "tests/deploy/test_serve_command.py",
    "tests/cluster/test_multinode.py",
    "tests/deploy/test_pipeline_bench.py",
    "tests/cluster/test_kv_xnode_engine.py",
    "tests/cluster/test_kv_cluster_multinode.py",
)

# The longest groups (minutes each on 2 cores) start first, so no worker is left running one
# alone at the end of ``make test``; the other groups follow, those with more tests first (xdist's
# own order, which ``make test``'s --no-loadscope-reorder hands over to this one), and the private
# clusters' last.
LONGEST_GROUPS = ("ray", "tests/workers/test_speculative.py")


def xdist_group_of(item: pytest.Item) -> str:
    """The one worker's queue a test joins: the session cluster's, or its module's."""
    module = item.nodeid.split("::")[0]
    if RAY_FIXTURES.intersection(item.fixturenames):
        return "ray"
    if module.startswith(PRIVATE_CLUSTER_PATHS):
        return module
    if module.startswith(RAY_PATHS):
        return "ray"
    return module


def queue_position(group: str, size: int) -> tuple[int, int, str]:
    """Where a group's tests go in ``make test``'s queue (the sort key of its tests)."""
    if group in LONGEST_GROUPS:
        return LONGEST_GROUPS.index(group), 0, group
    if group in PRIVATE_CLUSTER_PATHS:
        return len(LONGEST_GROUPS) + 1, PRIVATE_CLUSTER_PATHS.index(group), group
    return len(LONGEST_GROUPS), -size, group


def pytest_configure(config: pytest.Config) -> None:
    """``make test`` ends with each worker's and the longest groups' busy seconds."""
    worker_time.register(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group tests for ``pytest -n N --dist loadgroup`` (``make test``): every module stays on one
    worker, so its module-scoped models and HF references are built once, and every test of the
    session's Ray cluster joins one group; the longest groups go first. Without xdist the marks do
    nothing. ``tryfirst``: xdist's own hook reads the marks, so they must be set before it runs."""
    groups = {item: xdist_group_of(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    sizes = Counter(groups.values())
    items.sort(key=lambda item: queue_position(groups[item], sizes[groups[item]]))


@pytest.fixture
def unbuilt_kernels(monkeypatch, tmp_path):
    """The package as installed without a compiler: no C++ kernel libraries to load."""
    from raylm.model import kernels

    monkeypatch.setattr(kernels, "_DIRECTORY", tmp_path)
    kernels.unavailable_reason.cache_clear()
    yield
    monkeypatch.undo()
    kernels.unavailable_reason.cache_clear()


@pytest.fixture(scope="session")
def bundled_path():
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def bundled_model() -> LoadedModel:
    """The bundled SmolLM2 GGUF, dequantized to float32, loaded once per test session."""
    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture(scope="session")
def hf_bundled_tokenizer(bundled_path):
    """HF transformers' own reading of the bundled GGUF's tokenizer: the reference.

    transformers' GGUF converter ignores ``tokenizer.ggml.pre`` and always pre-tokenizes
    with plain ByteLevel. Upstream SmolLM2's tokenizer.json (and llama.cpp's "smollm"
    pre-tokenizer) first isolate every digit, which changes e.g. "a  1": ["a", "ĠĠ", "1"]
    instead of ["a", "Ġ", "Ġ1"->"Ġ","1"]. We restore the upstream pre-tokenizer; vocab,
    merges, special tokens and chat template stay as transformers read them.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_path.parent, gguf_file=bundled_path.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return tokenizer


@pytest.fixture(scope="session")
def hf_bundled_model(bundled_path):
    """HF transformers (torch, float32) on the same GGUF weights: the logits reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        bundled_path.parent, gguf_file=bundled_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_gqa_path(tmp_path_factory) -> Path:
    """A tiny random llama checkpoint with grouped KV heads, for engine tests that need no real text."""
    from tests.checkpoints import build_tiny_checkpoint

    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("tiny-gqa") / "m")
    return path


@pytest.fixture(scope="session")
def tiny_gqa_model(tiny_gqa_path) -> LoadedModel:
    """``tiny_gqa_path`` loaded."""
    return load_model(tiny_gqa_path)


@pytest.fixture(scope="module")
def optimized_xla():
    """For a module whose programs run long enough to repay XLA's optimizations (the 30-layer
    bundled model's reference loop: 58 s optimized against 76 s without): compile them on."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def serve_cluster():
    """One real local Ray cluster with Serve for the whole session (starting one costs ~20 s)."""
    from tests.serving import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def raylm_app(serve_cluster):
    """The bundled model served by two worker replicas behind the OpenAI router."""
    from tests.serving import TEST_DEPLOY

    return serve_cluster.deploy(TEST_DEPLOY)


@pytest.fixture
def compilations():
    """Programs compiled, or read back from the compilation cache, during the test (each one a name
    in the list): a steady state after warm-up must add none."""
    events: list[str] = []

    def listener(name: str, *_args, **_kwargs) -> None:
        if name in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


MAX_MEMORY_MAPPINGS = 16_384  # a quarter of the kernel's default vm.max_map_count (65530)


@pytest.fixture(autouse=True)
def _compiled_programs_released_before_mappings_run_out():
    """Every XLA CPU executable holds memory mappings until it is released, and jit keeps every
    program it compiled. The whole suite in one process compiles enough programs (each test
    builds engines of its own shapes; the speculative module alone passed 40,000 mappings) to
    reach the kernel's ``vm.max_map_count``, where compiling the next one segfaults inside XLA.
    After a test that leaves the process holding many, release them all; later tests compile
    what they use."""
    yield
    with open("/proc/self/maps") as maps:
        if sum(1 for _ in maps) > MAX_MEMORY_MAPPINGS:
            jax.clear_caches()
            gc.collect()


# Tests build many engines over the same few models and shapes (each builds its own jitted
# programs, so JAX's in-memory cache never sees a repeat), and XLA's backend compile is most of
# the suite's in-process time. The run's workers share one persistent compilation cache, fresh
# for every run (so no run depends on an earlier one): a program compiled once is read back by
# every later test that builds the same one. Programs compiled faster than this are not stored.
TEST_CACHE_MIN_COMPILE_S = 0.2


@pytest.fixture(scope="session")
def _run_compilation_cache_dir(tmp_path_factory, pytestconfig):
    """The directory every xdist worker of this run shares (the base temp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if hasattr(pytestconfig, "workerinput") else base
    path = root / "xla-compilation-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(autouse=True)
def _compilation_cache_of_the_run(_run_compilation_cache_dir):
    """Every test compiles through the run's cache, whatever the test before it set: ``raylm
    generate`` run in-process (tests/deploy/test_cli.py) points JAX's process-wide cache at the
    user's directory. Set again after the test too, for the next module's fixtures, which are
    built before its first test's."""
    from raylm.model.runtime.compilation_cache import enable_compilation_cache

    enable_compilation_cache(_run_compilation_cache_dir, TEST_CACHE_MIN_COMPILE_S)
    yield
    enable_compilation_cache(_run_compilation_cache_dir, TEST_CACHE_MIN_COMPILE_S)
