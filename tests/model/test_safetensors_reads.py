"""An HF checkpoint's tensors are read with plain file reads, not through safetensors' memory
map: the values are the file's, and no page of the file stays mapped (counted in the process's
RSS beside the copy) once a tensor is read."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from raylm.model.errors import ModelLoadError
from raylm.model.loaders.hf_checkpoint import _open, _Tensors
from tests.mapped_pages import AVAILABLE, mapped_kib


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    weights = {"w16": torch.randn(1024, 1024).to(torch.bfloat16), "w32": torch.randn(512, 1024),
               "f8": torch.randn(64, 256).to(torch.float8_e4m3fn), "ids": torch.arange(-5, 5, dtype=torch.int32)}
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file))
    return file, weights


def test_every_tensor_reads_as_stored(tmp_path):
    file, weights = _checkpoint(tmp_path)
    with _open(file) as handle:
        tensors = _Tensors({name: file for name in weights}, {file: handle})
        for name, want in weights.items():
            got = tensors.read(name)
            expected = want.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if want.dtype == torch.bfloat16 \
                else want.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) if want.dtype == torch.float8_e4m3fn \
                else want.numpy()
            assert got.dtype == expected.dtype and got.shape == expected.shape and got.flags.writeable
            np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
        assert tensors.read("absent") is None


@pytest.mark.skipif(not AVAILABLE, reason="reads Linux's /proc/self/smaps")
def test_reading_leaves_none_of_the_files_pages_mapped(tmp_path):
    file, weights = _checkpoint(tmp_path)
    with _open(file) as handle:
        tensors = _Tensors({name: file for name in weights}, {file: handle})
        for name in weights:
            tensors.read(name)
        assert mapped_kib(file) < file.stat().st_size / 1024 / 20  # (the header safe_open read, and its neighbours)
        handle.get_tensor("w32")  # safetensors' own read copies out of the map: the measure sees its pages
        assert mapped_kib(file) >= 512 * 1024 * 4 // 1024 * 0.9


def test_a_truncated_file_is_a_load_error_naming_the_tensor(tmp_path):
    file, weights = _checkpoint(tmp_path)
    with _open(file) as handle:
        tensors = _Tensors({name: file for name in weights}, {file: handle})
        header = json.loads(file.read_bytes()[8: 8 + int.from_bytes(file.read_bytes()[:8], "little")])
        last = max((name for name in weights), key=lambda name: header[name]["data_offsets"][1])
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size - 10)
        with pytest.raises(ModelLoadError, match=f"'{last}'.*truncated"):
            tensors.read(last)
