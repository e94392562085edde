"""Write the files people download, with random weights: Llama-3.2-3B- and Llama-3.1-8B-shaped GGUFs.

Why: raylm's figures must hold at the sizes and in the formats users serve (a Q4_K_M first, then
Q6_K and Q8_0), against llama-server on the same file. Hub downloads are not possible here, so
the shapes are the real models' and the weights random (Gaussian, std 0.02; outputs are noise,
benchmarks use ``ignore_eos``), with the bundled SmolLM2 tokenizer. An F16 file is written first
(benchmarks/make_family_gguf.py, ``--arch llama``), then llama.cpp's own ``llama-quantize`` makes
each quantized copy exactly as a user's download was made (its Q4_K_M mixes Q4_K and Q6_K).

    python -m raylm.benchmarks.make_test_ggufs --size 3b [--types Q4_K_M,Q6_K,Q8_0] [--dir DIR]
        [--llama-quantize PATH]

``--llama-quantize`` defaults to the one ``shared/peers/llama-server.sh build`` makes under
``$PEERS`` (default ``~/.cache/raylm-peers``); files go to ``DIR`` (default ``$PEERS/big``) as
``Random-3B.F16.gguf``, ``Random-3B.Q4_K_M.gguf``, ... An existing file is kept. Disk: the 8B
set takes 36 GB (F16 16 GB, Q8_0 8.5 GB, Q6_K 6.6 GB, Q4_K_M 4.9 GB).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from raylm.benchmarks.make_family_gguf import write_family_gguf

# name -> (layers, hidden, ffn, heads, kv_heads, head_dim, untied): the Hugging Face configs.
SIZES = {
    "1b": (16, 2048, 8192, 32, 8, 64, False),   # Llama-3.2-1B
    "3b": (28, 3072, 8192, 24, 8, 128, False),  # Llama-3.2-3B
    "8b": (32, 4096, 14336, 32, 8, 128, True),  # Llama-3.1-8B
}
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "raylm-peers"))
QUANTIZE = PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-quantize"


def make_test_ggufs(size: str, types: list[str], directory: Path, quantize: Path) -> list[Path]:
    """Write ``Random-<SIZE>.F16.gguf`` and one llama-quantize copy per type; returns the paths."""
    from raylm.model.config.registry import DEFAULT_MODEL, resolve_model_path

    layers, hidden, ffn, heads, kv_heads, head_dim, untied = SIZES[size]
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"Random-{size.upper()}"
    f16 = Path(f"{stem}.F16.gguf")
    if not f16.exists():
        write_family_gguf(f16, resolve_model_path(DEFAULT_MODEL), "llama", "F16", layers, hidden, ffn, heads,
                          kv_heads, head_dim, untied=untied)
    paths = [f16]
    for kind in types:
        out = Path(f"{stem}.{kind}.gguf")
        if not out.exists():
            subprocess.run([str(quantize), str(f16), str(out), kind], check=True, stdout=subprocess.DEVNULL)
        paths.append(out)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="3b")
    ap.add_argument("--types", default="Q4_K_M,Q6_K,Q8_0", help="llama-quantize types, comma-separated")
    ap.add_argument("--dir", type=Path, default=PEERS / "big")
    ap.add_argument("--llama-quantize", type=Path, default=QUANTIZE)
    a = ap.parse_args()
    if not a.llama_quantize.exists():
        raise SystemExit(f"{a.llama_quantize} not found: run shared/peers/llama-server.sh build, or pass --llama-quantize")
    for path in make_test_ggufs(a.size, [t for t in a.types.split(",") if t], a.dir, a.llama_quantize):
        print(f"{path}  {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
