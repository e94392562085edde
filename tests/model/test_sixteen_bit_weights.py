"""A float32 model keeps its checkpoint's bfloat16 / float16 matrices at 16 bits: the same
float32 numbers as widening them at load, bit for bit.

The kernels widen 16-bit weights exactly in registers (or an L1 panel) and run the float32
tiles, so every product is the float32 kernel's on the widened matrix; the references are the
float32 kernel itself, HF transformers in float32 on the same weights, and the engine serving
the model widened at load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.kernels import dense as dense_module
from raylm.model.kernels.dense import KERNEL_MAX_ROWS, dense, dense_matmul, half_matmul
from raylm.model.loaders.load import load_checkpoint, load_model
from raylm.model.quantization.quant_array import weight_bytes
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf
from tests.kept_and_expanded import served_kept_and_expanded
from tests.reference import hf_greedy
from tests.reruns import rerun_in_child

needs_kernel = pytest.mark.skipif(not dense_module.available(), reason="C++ kernel not built; XLA path tested")
HALVES = [jnp.bfloat16, jnp.float16]


def _matrix(n: int, k: int, dtype: jnp.dtype, seed: int) -> jax.Array:
    """Gaussian 16-bit weights with zeros, large values and (float16) subnormals."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, : min(k, 4)] = [0.0, -0.0, 3e-7, -6e-8][: min(k, 4)]  # float16 subnormals, bfloat16 normals
    w[rng.integers(0, n, 3), rng.integers(0, k, 3)] = [40.0, -600.0, 1e-3]
    return jnp.asarray(w).astype(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("n,k", [(4, 16), (7, 37), (13, 64), (130, 200), (64, 512)])
def test_kernel_is_the_float32_kernel_on_the_widened_matrix(dtype, n, k):
    """Both loop nests (the small-batch kernel up to KERNEL_MAX_ROWS rows, the prompt GEMM above),
    every M, tails in N and K: the float32 kernel's result on ``w.astype(float32)``, bit for bit."""
    w = _matrix(n, k, dtype, seed=n * k)
    widened = w.astype(jnp.float32)
    small, wide = jax.jit(half_matmul), jax.jit(dense_matmul)
    for m in (1, 2, 3, 5, 8, 17, 64, 65, 130):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
        got = np.asarray(small(x, w))
        np.testing.assert_array_equal(got, np.asarray(wide(x, widened)))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(widened, np.float64).T,
                               rtol=1e-4, atol=1e-2)


@needs_kernel
def test_eight_lane_family_too():
    """The kernel test with the 8-lane tiles forced (what AVX2 CPUs run; float16 by the portable
    bit arithmetic there)."""
    rerun_in_child(__file__, "test_kernel_is_the_float32_kernel", {"RAYLM_DENSE_NARROW_TILES": "1"})


@pytest.mark.parametrize("kernel", [True, False], ids=["unsharded", "sharded program"])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS + 8])
def test_dense_gives_what_the_widened_matrix_gives(kernel, rows):
    """Every path ``dense`` takes for 16-bit weights (the kernels; XLA's dot on the widened
    matrix, as sharded programs and accelerators run it) gives the float32 matrix's result on
    the same path, bit for bit; the LM head's ``out_dtype`` too."""
    for dtype in HALVES:
        w = _matrix(96, 128, dtype, seed=rows).reshape(96, 4, 32)
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, 4, 32)), jnp.float32)
        run = jax.jit(lambda x, w: dense(x, w, 2, kernel=kernel, out_dtype=jnp.float32))
        got = run(x, w)
        assert got.dtype == jnp.float32 and got.shape == (rows, 1, 96)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(run(x, w.astype(jnp.float32))))


def test_kernel_rejects_other_operands():
    if not dense_module.available():
        pytest.skip("C++ kernel not built")
    with pytest.raises(ValueError, match="float32 x and bfloat16/float16 w"):
        half_matmul(jnp.ones((1, 16), jnp.bfloat16), jnp.ones((4, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        half_matmul(jnp.ones((1, 8)), jnp.ones((4, 16), jnp.float16))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved as bfloat16, and HF's model on the same (bfloat16) weights in float32."""
    path, hf_model = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("float32") / "llama")
    return _sixteen_bit_copy(path, hf_model, torch.bfloat16, tmp_path_factory.mktemp("bf16") / "llama")


def _sixteen_bit_copy(path, hf_model, dtype: torch.dtype, out):
    """``hf_model`` saved in ``dtype`` into ``out``; the model's parameters rounded to ``dtype``
    in place (its buffers, RoPE's inverse frequencies, stay float32 as HF computes them)."""
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param.to(dtype).to(torch.float32))
    copy = type(hf_model)(hf_model.config).eval()
    copy.load_state_dict(hf_model.state_dict())
    copy.to(dtype).save_pretrained(out, safe_serialization=True)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (out / extra).write_bytes((path / extra).read_bytes())
    return out, hf_model


def _matches_hf(config, params, hf_model) -> None:
    ids = np.random.RandomState(0).randint(3, 320, size=45).tolist()
    generator = SingleSequenceGenerator(config, params)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, 16)) == hf_greedy(hf_model, ids, 16)


def test_bf16_checkpoint_keeps_16_bit_matrices_and_matches_hf(bf16_checkpoint):
    path, hf_model = bf16_checkpoint
    config, params = load_checkpoint(path, keep_blocks=True)
    layer = params.layers[0]
    for matrix in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, params.embed, params.lm_head):
        assert matrix is None or matrix.dtype == jnp.bfloat16
    assert layer.attn_norm.dtype == params.final_norm.dtype == jnp.float32
    _, widened = load_checkpoint(path)
    assert widened.embed.dtype == jnp.float32
    assert 2 * weight_bytes(params) == pytest.approx(weight_bytes(widened), rel=0.01)
    _matches_hf(config, params, hf_model)


def test_int8_of_a_kept_model_is_int8_of_the_widened_one(bf16_checkpoint):
    path, _ = bf16_checkpoint
    kept = load_model(path, quantization="int8", keep_blocks=True).params
    widened = load_model(path, quantization="int8").params
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(widened)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_served_kept_16_bit_is_bit_identical_to_widened(bf16_checkpoint):
    """The engine, batched and alone, decode rows in the small-batch kernel and prompt chunks in
    the prompt GEMM: the same tokens and logprobs as the checkpoint widened at load."""
    path, _ = bf16_checkpoint
    runs, sizes = served_kept_and_expanded(path)
    assert runs["keep"] == runs["expand"]
    assert sizes["expand"] > 1.8 * sizes["keep"]


@pytest.mark.parametrize("qtype,dtype", [(GGMLQuantizationType.F16, jnp.float16),
                                         (GGMLQuantizationType.BF16, jnp.bfloat16)], ids=["F16", "BF16"])
def test_16_bit_gguf_keeps_16_bit_matrices_and_matches_hf(qtype, dtype, tmp_path):
    path, hf_model = build_tiny_checkpoint("llama-gqa", tmp_path / "float32")
    sixteen, hf_model = _sixteen_bit_copy(path, hf_model, torch.float16 if dtype == jnp.float16 else torch.bfloat16,
                                          tmp_path / "sixteen")
    file = export_gguf(sixteen, tmp_path / "model.gguf", qtype=qtype)
    config, params = load_checkpoint(file, keep_blocks=True)
    layer = params.layers[0]
    for matrix in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, params.embed, params.lm_head):
        assert matrix is None or matrix.dtype == dtype
    _, widened = load_checkpoint(file)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(widened)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    _matches_hf(config, params, hf_model)


@pytest.mark.parametrize("variant", ["llama-tied", "gemma2", "qwen2-moe"])
def test_other_families_kept_16_bit_match_hf(variant, tmp_path):
    """A tied embedding (the LM head by the 16-bit kernel), Gemma's norms stored as ``w`` (+1
    after widening), and an MoE layer (experts widened at load for the grouped kernel, the
    shared expert kept 16-bit)."""
    path, hf_model = build_tiny_checkpoint(variant, tmp_path / "float32")
    sixteen, hf_model = _sixteen_bit_copy(path, hf_model, torch.bfloat16, tmp_path / "bf16")
    config, params = load_checkpoint(sixteen, keep_blocks=True)
    assert params.embed.dtype == jnp.bfloat16 and params.final_norm.dtype == jnp.float32
    if config.moe is not None:
        layer = next(lp for i, lp in enumerate(params.layers) if config.is_sparse(i))
        assert layer.w_experts_gate_up.dtype == layer.router.dtype == jnp.float32
        assert layer.w_shared_gate_up.dtype == jnp.bfloat16
    _matches_hf(config, params, hf_model)
