"""Every GGUF block type kept as stored (K-quants, IQ4, Q5, MXFP4): the gguf package's numbers, bit for bit.

The references are independent of raylm's code: ``gguf.quants.dequantize`` for the values of
blocks with random bits (every bit pattern a file can hold, float16 scales of a sane size),
the float32 kernel on that dequantized matrix for every product, and HF transformers on the
weights a Q4_K_M-style file holds for a whole model.
"""

from __future__ import annotations

import copy
import tracemalloc

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import ModelLoadError
from raylm.model.kernels import dense as dense_module
from raylm.model.kernels.dense import dense_matmul, gguf_matmul
from raylm.model.kernels.grouped_matmul import grouped_matmul
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.load import load_model
from raylm.model.quantization.gguf_blocks import GGUF_BLOCK_TYPES, GgufBlocks, from_gguf, map_rows
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, load_stored, q4_k_m_types, random_blocks
from tests.kept_and_expanded import served_kept_and_expanded
from tests.mapped_pages import AVAILABLE, mapped_kib
from tests.reference import hf_greedy
from tests.reruns import rerun_in_child

T = gguf.GGMLQuantizationType
NEW_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.Q5_0, T.Q5_1, T.MXFP4]
needs_kernel = pytest.mark.skipif(not dense_module.available(), reason="C++ kernel not built; XLA path tested")


def _blocks(kind: T, n: int, k: int, seed: int = 0) -> tuple[GgufBlocks, np.ndarray]:
    """Random blocks as raylm holds them and as the gguf package dequantizes them."""
    raw = random_blocks(kind, (n, k), seed)
    expected = gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32)
    return from_gguf(raw, kind, (n, k), "blk.0.test.weight"), expected


def test_every_type_the_kernels_read_is_kept():
    assert set(NEW_TYPES) | {T.Q4_0, T.Q4_1, T.Q8_0} == set(GGUF_BLOCK_TYPES)


@pytest.mark.parametrize("kind", NEW_TYPES, ids=lambda t: t.name)
def test_values_are_the_gguf_packages_dequantization(kind):
    blocks, expected = _blocks(kind, 11, 512)
    np.testing.assert_array_equal(np.asarray(blocks.dequantize()), expected)
    rows = jnp.asarray([[3, 0], [10, 3]])
    np.testing.assert_array_equal(np.asarray(blocks.to_device().rows(rows, jnp.float32)), expected[np.asarray(rows)])
    assert blocks.nbytes <= expected.nbytes * 12 / 32  # at most 12 bits a weight (Q2_K's bytes and two scales per 16)


@pytest.mark.parametrize("kind,ratio", [(T.Q4_K, 4.75 / 4.5), (T.Q5_K, 8.75 / 5.5), (T.Q6_K, 8.75 / 6.5625),
                                        (T.IQ4_XS, 4.5 / 4.25), (T.Q3_K, 8.75 / 3.4375)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K"])
def test_two_level_scales_are_held_as_the_file_holds_them(kind, ratio):
    """The K-quants keep int8 scales per group and float32 ones per super-block: a Q4_K matrix
    is held in 4.75 bits a weight (its file: 4.5), IQ4_XS in 4.5 (4.25), the types held as bytes in 8.75."""
    blocks, expected = _blocks(kind, 16, 1024)
    assert blocks.two_level and blocks.scale.dtype == np.int8
    file_bytes = gguf.GGML_QUANT_SIZES[kind][1] * expected.size // gguf.GGML_QUANT_SIZES[kind][0]
    assert blocks.nbytes == pytest.approx(file_bytes * ratio)


@pytest.mark.parametrize("kind,bits", [(T.IQ4_NL, 5), (T.IQ4_XS, 4.5), (T.MXFP4, 5)], ids=lambda t: getattr(t, "name", t))
def test_codebook_types_are_held_as_their_4_bit_codes(kind, bits):
    """IQ4 and MXFP4 keep the file's nibbles and look each code up in a 16-entry codebook: 4 bits a
    weight plus the scales (a float32 per 32, or IQ4_XS's two levels), not a byte of its value."""
    blocks, expected = _blocks(kind, 16, 1024)
    assert blocks.nibbles and blocks.codebook is not None and not blocks.has_offset
    assert blocks.nbytes * 8 == bits * expected.size
    widened = blocks.widened()  # the layout before codebooks: signed bytes of the values
    assert not widened.nibbles and widened.codebook is None and widened.nbytes > 1.7 * blocks.nbytes
    np.testing.assert_array_equal(np.asarray(widened.dequantize()), expected)


@needs_kernel
@pytest.mark.parametrize("kind", NEW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 17, 70])
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (130, 256)])
def test_kernel_is_the_float32_kernel_on_the_dequantized_matrix(kind, m, n, k):
    """Decode rows (1..17: in registers, through the panel) and a prompt chunk (70 rows: the
    prompt GEMM), against the float32 kernel on gguf's dequantization, bit for bit."""
    blocks, w = _blocks(kind, n, k, seed=m + n)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    got = np.asarray(gguf_matmul(x, blocks.to_device()))
    np.testing.assert_array_equal(got, np.asarray(dense_matmul(x, jnp.asarray(w))))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ w.astype(np.float64).T, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_eight_lane_family_too():
    """The kernel test above with the 8-lane tiles forced (what AVX2 CPUs run)."""
    rerun_in_child(__file__, "test_kernel_is_the_float32_kernel", {"RAYLM_DENSE_NARROW_TILES": "1"})


@needs_kernel
@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K, T.Q5_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4], ids=lambda t: t.name)
def test_grouped_experts_in_blocks_are_the_float32_experts(kind):
    experts, k, n = 4, 256, 24
    blocks, w = _blocks(kind, experts * n, k, seed=5)
    stacked = blocks._map(lambda a: a.reshape(experts, n, a.shape[-1])).to_device()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((9, k)), jnp.float32)
    sizes = jnp.asarray([2, 0, 4, 3], jnp.int32)
    got = grouped_matmul(x, stacked, sizes, kernel=True)
    expected = grouped_matmul(x, jnp.asarray(w.reshape(experts, n, k)), sizes, kernel=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    if blocks.codebook:  # and the bytes layout held before codebooks, bit for bit
        widened = blocks.widened()._map(lambda a: a.reshape(experts, n, a.shape[-1])).to_device()
        np.testing.assert_array_equal(np.asarray(grouped_matmul(x, widened, sizes, kernel=True)), np.asarray(got))


def test_types_mixed_in_one_fused_matrix_share_an_exact_layout():
    """A Q4_K_M file's Q4_K query and key beside its Q6_K value projection (and a Q8_0 one)
    fuse into one block matrix holding every weight exactly."""
    q, eq = _blocks(T.Q4_K, 8, 256, seed=1)
    v, ev = _blocks(T.Q6_K, 4, 256, seed=2)
    o, eo = _blocks(T.Q8_0, 4, 256, seed=3)
    fused = map_rows(lambda *a: np.concatenate(a), q, v, o)
    assert isinstance(fused, GgufBlocks) and not fused.nibbles and fused.group == 16 and fused.has_offset
    np.testing.assert_array_equal(np.asarray(fused.dequantize()), np.concatenate([eq, ev, eo]))
    same = map_rows(lambda *a: np.concatenate(a), q, q)
    assert same.nibbles and same.group == 32
    # K-quants alone keep their two levels: int8 scales and offsets per 16 under d and dmin
    k_quants = map_rows(lambda *a: np.concatenate(a), q, v)
    assert k_quants.two_level and k_quants.group == 16 and k_quants.has_offset and k_quants.scale.dtype == np.int8
    np.testing.assert_array_equal(np.asarray(k_quants.dequantize()), np.concatenate([eq, ev]))
    assert k_quants.nbytes * 8 == 9.25 * 12 * 256  # bits a weight: float32 tables per 16 took 12


def test_codebook_types_fuse_as_nibbles_alone_and_as_bytes_beside_another_type():
    """IQ4_NL query and key keep their codes and codebook; beside a Q8_0 value projection, or an
    MXFP4 one (another codebook), every matrix becomes bytes of its values, exactly."""
    q, eq = _blocks(T.IQ4_NL, 8, 256, seed=1)
    v, ev = _blocks(T.Q8_0, 4, 256, seed=2)
    x, ex = _blocks(T.MXFP4, 4, 256, seed=3)
    same = map_rows(lambda *a: np.concatenate(a), q, q)
    assert same.nibbles and same.codebook == q.codebook
    np.testing.assert_array_equal(np.asarray(same.dequantize()), np.concatenate([eq, eq]))
    for other, expected in ((v, ev), (x, ex)):
        fused = map_rows(lambda *a: np.concatenate(a), q, other)
        assert not fused.nibbles and fused.codebook is None
        np.testing.assert_array_equal(np.asarray(fused.dequantize()), np.concatenate([eq, expected]))


def _write(tmp_path, tensors: dict[str, tuple[np.ndarray, T]]):
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, (raw, kind) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(tmp_path / "t.gguf")


def test_loading_never_expands_the_matrix_to_float32(tmp_path):
    """A Q4_K matrix of 16M weights (64 MB as float32) loads with temporaries bounded by the
    transcoder's chunks: the peak traced allocation stays under a third of float32's bytes."""
    rows, k = 8192, 2048
    file = _write(tmp_path, {"token_embd.weight": (random_blocks(T.Q4_K, (rows, k), 0), T.Q4_K)})
    tracemalloc.start()
    try:
        blocks = file.tensor("token_embd.weight", keep_blocks=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    float_bytes = rows * k * 4
    assert isinstance(blocks, GgufBlocks) and blocks.nbytes < float_bytes / 2.5
    assert peak < float_bytes / 3, f"peak {peak / 2**20:.1f} MiB loading a {float_bytes / 2**20:.0f} MiB matrix"


@pytest.mark.skipif(not AVAILABLE, reason="reads Linux's /proc/self/smaps and unmaps with madvise")
def test_a_tensor_copied_out_of_the_file_leaves_no_pages_mapped(tmp_path):
    """Kept blocks (transcoded) and dequantized floats are copies: their file pages must leave the
    process's RSS as each tensor is read, not stay mapped (beside the copy) until the file's map is
    freed; a 16-bit matrix kept as a view of the file stays mapped."""
    file = _write(tmp_path, {"token_embd.weight": (random_blocks(T.Q4_0, (4096, 2048), 0), T.Q4_0),
                             "output.weight": (random_blocks(T.Q8_0, (1024, 2048), 1), T.Q8_0),
                             "blk.0.ffn_up.weight": (np.ones((512, 2048), np.float16), T.F16)})
    path = tmp_path / "t.gguf"
    tensor_kib = {name: info.n_bytes // 1024 for name, info in file._tensors.items()}
    blocks = file.tensor("token_embd.weight", keep_blocks=True)
    floats = file.tensor("output.weight")
    assert isinstance(blocks, GgufBlocks) and floats.dtype == np.float32
    copied_kib = tensor_kib["token_embd.weight"] + tensor_kib["output.weight"]
    # (the header's pages and the kernel's fault-around neighbours stay: a few dozen KiB)
    assert mapped_kib(path) < copied_kib / 20, "the copied tensors' pages are still mapped"
    half = file.tensor("blk.0.ffn_up.weight", keep_blocks=True)
    assert half.dtype == np.float16 and float(half.sum(dtype=np.float32)) == half.size
    assert mapped_kib(path) >= tensor_kib["blk.0.ffn_up.weight"]  # the view's pages: the measure sees them


def test_a_truncated_tensor_is_a_load_error_naming_it(tmp_path):
    raw = random_blocks(T.Q6_K, (4, 256), 0)
    file = _write(tmp_path, {"blk.0.ffn_down.weight": (raw, T.Q6_K)})
    info = file._tensors["blk.0.ffn_down.weight"]
    file._tensors[info.name] = info._replace(data=info.data[:, :-10])  # bytes missing from the tensor
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_down.weight'.*bytes for 4 x 256 Q6_K.*truncated"):
        file.tensor("blk.0.ffn_down.weight", keep_blocks=True)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        from_gguf(np.zeros((2, 210), np.uint8), T.Q6_K, (2, 224), "blk.1.attn_v.weight")


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory):
    """A tiny Qwen3 (inputs of 256 and 512: whole K-quant super-blocks) as a Q4_K_M-style GGUF,
    and the HF model holding the weights the file holds."""
    tmp_path = tmp_path_factory.mktemp("q4_k_m")
    directory, hf_model = build_tiny_checkpoint("qwen3", tmp_path / "hf", hidden_size=256, intermediate_size=512,
                                                head_dim=64, tie_word_embeddings=False)
    path = export_gguf(directory, tmp_path / "q4_k_m.gguf", q4_k_m_types)
    load_stored(hf_model, path)
    return path, hf_model


def test_a_q4_k_m_model_gives_hfs_logits_and_greedy_tokens(q4_k_m_model):
    path, hf_model = q4_k_m_model
    model = load_model(path, keep_blocks=True)
    layer = model.params.layers[0]
    assert all(isinstance(m, GgufBlocks) for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down,
                                                    model.params.embed, model.params.lm_head))
    assert layer.w_down.group == 16 and layer.w_gate_up.nibbles  # Q6_K and Q4_K as stored
    ids = np.random.RandomState(0).randint(3, 320, size=40).tolist()
    generator = SingleSequenceGenerator(model.config, model.params)
    # HF in float64: a float32 reference once came out 2e-4 off at one position in one xdist
    # worker (raylm's logits there were bit-identical to a quiet run's), so the bound measured torch.
    with torch.no_grad():
        reference = copy.deepcopy(hf_model).double()(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, 12)) == hf_greedy(hf_model, ids, 12)


def test_a_q4_k_m_model_served_from_blocks_is_bit_identical_to_float32(q4_k_m_model):
    """The engine, batched and alone, decode rows in the block kernels and prompt chunks in the
    prompt GEMM: the same tokens and logprobs as the file expanded to float32."""
    path, _ = q4_k_m_model
    runs, sizes = served_kept_and_expanded(path)
    assert runs["keep"] == runs["expand"]
    assert sizes["expand"] > 3.5 * sizes["keep"]
