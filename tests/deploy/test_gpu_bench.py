"""The GPU benchmark (benchmarks/gpu_bench.py): its random model against Llama's published sizes,
its block tables and arithmetic on hand-computed cases, a part's failure kept apart, lowering for
a GPU, and a smoke run of every part on the tiny model (the kernel in interpret mode) that checks
each figure is there, finite, consistent with its inputs, and that the kernel's greedy tokens
agree with the jnp path's: not its timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.benchmarks import gpu_bench
from raylm.benchmarks import gpu_bench_model as bm
from raylm.model.decoder.params import shape_mismatches

# Published parameter counts: Llama-3.2-1B (tied embeddings) and Llama-3.1-8B.
LLAMA_PARAMS = {"1b": 1_235_814_400, "8b": 8_030_261_248}


@pytest.mark.parametrize("shape", ["1b", "8b"])
def test_random_llama_has_the_published_size(shape):
    config = bm.model_config(shape)
    params = jax.eval_shape(lambda: bm.random_params(config, jnp.bfloat16))
    assert shape_mismatches(params, config) == []
    assert sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params)) \
        == 2 * LLAMA_PARAMS[shape]
    assert (params.lm_head is None) == (shape == "1b")


def test_random_weights_are_scaled_by_their_fan_in():
    config = bm.model_config("tiny")
    params = bm.random_params(config, jnp.float32)
    layer = params.layers[1]
    assert np.all(np.asarray(layer.attn_norm) == 1) and np.all(np.asarray(params.final_norm) == 1)
    # wo [D, H, Dh] takes H * Dh inputs; w_down [D, I] takes I; the embedding [V, D] takes D.
    for w, fan_in in ((layer.wo, config.num_heads * config.head_dim), (layer.w_down, config.intermediate_size),
                      (params.embed, config.hidden_size)):
        assert np.std(np.asarray(w)) == pytest.approx(fan_in ** -0.5, rel=0.1)
    assert not np.array_equal(np.asarray(params.layers[0].wqkv), np.asarray(layer.wqkv))
    assert layer.router is None and layer.q_norm is None


def test_block_tables_give_each_row_its_blocks_after_the_null_block():
    tables, num_blocks = bm.block_tables(2, 40)  # 3 blocks a row, width: power of two above 3 + 1, at least 8
    assert num_blocks == 7
    np.testing.assert_array_equal(tables, [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 6, 0, 0, 0, 0, 0]])
    tables, num_blocks = bm.block_tables(1, 4096, width=256)
    assert num_blocks == 257 and tables.shape == (1, 256) and tables[0, -1] == 256


def test_nominal_figures_by_device_kind():
    assert bm.nominal(bm.HBM_TBPS, "NVIDIA H100 80GB HBM3") == 3.35
    assert bm.nominal(bm.HBM_TBPS, "NVIDIA H200") == 4.8
    assert bm.nominal(bm.PEAK_BF16_TFLOPS, "NVIDIA H200") == 989.0
    assert bm.nominal(bm.HBM_TBPS, "cpu") is None


def test_a_failing_part_is_reported_and_the_others_still_run(monkeypatch, capsys):
    bench = gpu_bench.Bench("tiny", "float32", 1, None, None, abstract=True)

    def broken(b):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu_bench.RUNNERS, "attention", broken)
    monkeypatch.setitem(gpu_bench.RUNNERS, "decode", lambda b: b.report("decode.tok_s_1x8", 3.0))
    gpu_bench.run_parts(bench, ["attention", "decode"])
    assert bench.errors == {"attention": "RuntimeError: no such kernel"}
    assert bench.figures == {"decode.tok_s_1x8": 3.0}
    assert "attention FAILED: RuntimeError: no such kernel" in capsys.readouterr().out


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        gpu_bench.main(["--shape", "tiny", "--parts", "attention,speed"])


def test_lower_only_lowers_the_kernel_for_a_gpu():
    result = gpu_bench.main(["--shape", "tiny", "--lower-only", "--parts", "attention"])
    assert result["errors"] == {} and result["figures"] == {}
    assert result["lowered"] == {"attention.kernel[4x80]": 1, "attention.jnp[4x80]": 0,
                                 "attention.kernel[1x80]": 1, "attention.jnp[1x80]": 0}


def test_the_script_imports_no_serving_stack():
    """The GPU image has jax but no Ray, torch or transformers: the script must not need them."""
    code = ("import sys, raylm.benchmarks.gpu_bench; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'transformers', 'starlette'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def _tiny_prefill_flops() -> int:
    """2 prompts of 32 tokens through the tiny Llama (hidden 64, 2 layers, 4 heads of 16, 2 KV
    heads, MLP 128, vocab 512), by hand: per layer QKV 2*(2+2)*16*64, output 64*4*16, gate/up
    2*128*64, down 64*128 weights; the LM head 512*64 for each prompt's last token; attention
    4*4*16 per key read, token t reading t keys."""
    layer = 2 * 4 * 16 * 64 + 64 * 4 * 16 + 2 * 128 * 64 + 64 * 128
    keys = 2 * sum(range(1, 33))
    return 2 * (2 * layer * 64 + 512 * 64 * 2) + 2 * (4 * 4 * 16) * keys


def test_smoke_run_prints_every_part_and_the_kernel_agrees(tmp_path):
    out = tmp_path / "gpu.json"
    # The figures' sizes are what is checked, not speed: XLA's cheapest CPU compile keeps it short.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    run = subprocess.run([sys.executable, "-m", "raylm.benchmarks.gpu_bench", "--shape", "tiny", "--rounds", "1",
                          "--hbm-tbps", "0.01", "--peak-tflops", "0.1", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("device: cpu (cpu), jax ") and "MISMATCH" not in run.stdout
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["interpret"] and result["dtype"] == "float32"
    figures = result["figures"]
    for part in gpu_bench.PARTS:
        named = [name for name in figures if name.startswith(part + ".")]
        assert named, f"{part} reported nothing"
        for name in named:
            assert math.isfinite(figures[name]) and f"{name} = " in run.stdout
    # float32 pools: the kernel computes exactly, so greedy decoding agrees token for token.
    assert figures["check.tokens_agreeing"] == gpu_bench.CHECK_ROWS * gpu_bench.CHECK_STEPS
    assert figures["check.first_step_max_logit_diff"] < 1e-4 and figures["check.first_step_min_top2_gap"] >= 0
    assert figures["attention.max_abs_diff_4"] < 1e-5 and figures["attention.max_abs_diff_1"] < 1e-5
    assert all(figures[f"decode.tok_s_{r}x{s}"] > 0 for r in (1, 4) for s in (1, 4))
    # The ratios divide the rates they name.
    per_token = 1 / figures["decode.tok_s_1x4"]
    assert figures["decode.roofline_fraction_1"] == pytest.approx(figures["decode.weight_bytes"] / 0.01e12 / per_token)
    rates = figures["decode.tok_s_4x4"], figures["decode.tok_s_1x4"]
    assert figures["decode.streams_4_over_1"] == pytest.approx(rates[0] / rates[1])
    seconds = 64 / figures["prefill.tok_s"]
    assert figures["prefill.tflop_s"] * 1e12 * seconds == pytest.approx(_tiny_prefill_flops())
    assert figures["prefill.peak_fraction"] == pytest.approx(figures["prefill.tflop_s"] / 0.1)
    assert figures["decode.weight_bytes"] == 4 * (2 * (2 * 4 * 16 * 64 + 64 * 4 * 16 + 2 * 128 * 64 + 64 * 128 + 2 * 64)
                                          + 512 * 64 + 64)
