"""The installed ``raylm`` console script, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raylm.model.text.tokenizer import Tokenizer
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy

RAYLM = str(Path(sys.executable).parent / "raylm")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RAYLM, *args], capture_output=True, text=True, timeout=300)


def test_generate_paris():
    result = _run(
        "generate", "--model", "smollm2-135m-instruct", "--prompt", "The capital of France is",
        "--max-tokens", "8", "--temperature", "0",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "loading smollm2-135m-instruct" in result.stderr and "tokens/s" in result.stderr


def test_generate_chat(tmp_path):
    result = _run("generate", "--prompt", "Say hello.", "--chat", "--max-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_bad_model_is_a_clear_error(tmp_path):
    result = _run("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert result.returncode == 2
    assert "error: model" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "mistral-sliding"])
def test_generate_serves_each_family_checkpoint_as_hf_decodes_it(tmp_path, family):
    """`raylm generate --model DIR` on each newer family's checkpoint prints the text of HF's own
    greedy continuation of the same prompt."""
    path, hf_model = build_tiny_checkpoint(family, tmp_path / family)
    prompt = "the cat sat on the mat and"
    tokenizer = Tokenizer.from_hf_dir(path)
    expected = tokenizer.decode(hf_greedy(hf_model, tokenizer.encode(prompt), 8))
    result = _run("generate", "--model", str(path), "--prompt", prompt, "--max-tokens", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    universal_newlines = (expected + "\n").replace("\r\n", "\n").replace("\r", "\n")  # as text-mode pipes read it
    assert result.stdout == universal_newlines
