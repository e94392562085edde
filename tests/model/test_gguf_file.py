"""raylm's GGUF reader (model/loaders/gguf_file.py) parses to exactly what gguf's own reader does: every
metadata field (values, types, offsets) and every tensor (name, type, shape, bytes), with the
tensors left as views of the file's memory map rather than copies."""

from __future__ import annotations

import gguf
import numpy as np

from raylm.model.config.registry import DEFAULT_MODEL, resolve_model_path
from raylm.model.loaders.gguf_file import GGUFReader


def test_the_bundled_file_parses_to_what_ggufs_reader_gives():
    path = str(resolve_model_path(DEFAULT_MODEL))
    ours, theirs = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert mine.contents() == field.contents(), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (tensor.tensor_type, tensor.data_offset,
                                                                     tensor.n_bytes), tensor.name
        assert mine.shape.tolist() == tensor.shape.tolist() and mine.data.dtype == tensor.data.dtype, tensor.name
        assert np.array_equal(mine.data, tensor.data), tensor.name
        assert not mine.data.flags.owndata, tensor.name  # a view of the mapped file, not a copy
