"""Another commit's source tree, importable as ``raylm`` in a child process: for benchmarks that
run a baseline commit beside this tree.

``export_baseline`` writes the commit out (``git archive``) and builds its C++ kernels in place;
``import_env`` gives a child process an environment whose ``raylm.*`` imports resolve into that
tree (a folder of symlinks ``raylm/model -> TREE/model``, ... ahead of this checkout's editable
install on ``PYTHONPATH``). A baseline must use the ``raylm`` namespace: a commit from 08cf0bb
on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("model", "cache", "workers", "router", "cluster", "deploy", "benchmarks")


def export_baseline(rev: str) -> Path:
    """``git archive`` of ``rev`` into a fresh temporary directory (the shared tree is untouched),
    its C++ kernels built in place as pip would build them (not installed)."""
    target = Path(tempfile.mkdtemp(prefix="raylm-baseline-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    if not (target / "model" / "kernels" / "__init__.py").exists() or not (target / "setup.py").exists():
        raise SystemExit(f"{rev} has no model/kernels package or setup.py: not a raylm tree")
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=target, check=True,
                   capture_output=True)
    return target


def import_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``raylm.*`` importing from ``tree``."""
    farm = Path(tempfile.mkdtemp(prefix="raylm-imports-")) / "raylm"
    farm.mkdir()
    for folder in FOLDERS:
        if (tree / folder).is_dir():
            (farm / folder).symlink_to(tree / folder, target_is_directory=True)
    return dict(os.environ, PYTHONPATH=str(farm.parent))
