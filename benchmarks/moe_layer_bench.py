"""One mixture-of-experts feed-forward layer against a dense layer of the same active parameters
and against the all-experts-dense computation it replaces, per row count.

The MoE layer (``model.decoder.moe.moe_block``: route, sort the (token, k) pairs by expert, the grouped
matmul, un-sort and combine) runs with the C++ grouped kernel (``--paths kernel``, what a
single-device engine step runs on CPU) and with ``jax.lax.ragged_dot`` (``ragged_dot``, what
XLA runs when the kernel cannot: a sharded program, another backend). The dense layer is a
gated MLP whose intermediate size is ``top_k * expert_size`` (the FLOPs one token spends in
the MoE layer) through ``model.kernels.dense`` as a decode step runs it. "all experts" computes every
expert on every row (one dense einsum) and weights them by the routing, zero for the experts
a row did not pick: what a model without a grouped matmul would do. ``int8`` / ``q4_1`` run the
kernel on the same experts quantized (int8 with a scale per channel; GGUF Q4_1 blocks as a file
stores them), read as stored; ``int8_widened`` converts the int8 experts to float32 inside the
program first (what the grouped path did before the kernel read 8-bit experts). ``q4_0`` / ``mxfp4``
run random GGUF blocks of those types (a DeepSeek-V2-Lite Q4_0 file's experts, gpt-oss's) in the
exact mode, and ``q4_0_integer`` / ``mxfp4_integer`` the same blocks packed for the integer compute
mode (``activation_quantization: int8``: int8 activations, the grouped integer kernel of
model/kernels/int8_matmul.py); the ratio printed is exact / integer on the same blocks. ``mxfp4_bytes``
runs the MXFP4 blocks with each 4-bit code widened to a signed byte of its value (``GgufBlocks.widened``:
how they were held before the kernels looked codes up in a codebook), beside ``mxfp4``. Weights are random
float32 and far larger than the caches, so they stream from memory as in a real step; the
paths are jitted programs over the same arrays, timed in alternating rounds (median).

    python -m raylm.benchmarks.moe_layer_bench [--rows 1,16,64] [--experts 8] [--top-k 2]
        [--hidden 1024] [--expert-size 1536] [--rounds 7]
        [--paths kernel,int8,int8_widened,q4_1,ragged_dot,dense,all_experts,q4_0,q4_0_integer,mxfp4,mxfp4_integer,mxfp4_bytes]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from raylm.benchmarks.dense_bench import time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-size", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--paths", default="kernel,int8,int8_widened,q4_1,ragged_dot,dense,all_experts")
    args = parser.parse_args()

    from gguf import GGMLQuantizationType, quants

    from raylm.benchmarks.random_blocks import random_blocks
    from raylm.model.config.moe import MoeConfig
    from raylm.model.decoder.layers import gated_mlp
    from raylm.model.decoder.moe import moe_block, route
    from raylm.model.decoder.params import LayerParams
    from raylm.model.kernels.grouped_matmul import available
    from raylm.model.quantization.gguf_blocks import from_gguf
    from raylm.model.quantization.int8_panels import pack_int8_experts
    from raylm.model.quantization.quant_array import quantize

    E, k, D, I = args.experts, args.top_k, args.hidden, args.expert_size
    moe = MoeConfig(num_experts=E, top_k=k, expert_size=I, norm_topk_prob=True, sparse_layers=(True,))
    rng = np.random.default_rng(0)

    def weights(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5)

    layer = LayerParams(attn_norm=None, wqkv=None, wo=None, mlp_norm=None, router=weights(E, D),
                        w_experts_gate_up=weights(E, 2, I, D), w_experts_down=weights(E, D, I))
    dense_gate_up, dense_down = weights(2, k * I, D), weights(D, k * I)

    def experts_as(convert) -> LayerParams:
        return dataclasses.replace(layer, w_experts_gate_up=convert(layer.w_experts_gate_up),
                                   w_experts_down=convert(layer.w_experts_down))

    def q4_1(w: jax.Array):
        kind = GGMLQuantizationType.Q4_1
        return from_gguf(quants.quantize(np.asarray(w), kind), kind, w.shape).to_device()

    def widened(p: LayerParams) -> LayerParams:
        return dataclasses.replace(p, w_experts_gate_up=p.w_experts_gate_up.dequantize(),
                                   w_experts_down=p.w_experts_down.dequantize())

    int8_layer = experts_as(lambda w: quantize(w, "int8"))

    def all_experts(x: jax.Array, layer: LayerParams) -> jax.Array:
        h = x.reshape(-1, D)
        routing = route(h, layer.router, moe)
        # Every expert's gate/up as one [E*2*I, D] matrix (XLA CPU's best dot: a weight with
        # several output dims made it copy the whole matrix on every call, see model/kernels/dense.py).
        gate_up = jnp.einsum("td,nd->tn", h, layer.w_experts_gate_up.reshape(E * 2 * I, D)).reshape(-1, E, 2, I)
        y = jnp.einsum("tei,edi->ted", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], layer.w_experts_down)
        weight = jnp.zeros((h.shape[0], E), jnp.float32).at[jnp.arange(h.shape[0])[:, None], routing.experts].set(
            routing.weights)
        return jnp.einsum("ted,te->td", y, weight).reshape(x.shape)

    def moe_kernel(x: jax.Array, p: LayerParams) -> jax.Array:
        return moe_block(x, p, moe, "silu", kernel=True)[0]

    programs = {
        "kernel": (jax.jit(moe_kernel), layer),
        "int8": (jax.jit(moe_kernel), int8_layer),
        "int8_widened": (jax.jit(lambda x, p: moe_kernel(x, widened(p))), int8_layer),
        "ragged_dot": (jax.jit(lambda x, p: moe_block(x, p, moe, "silu")[0]), layer),
        "dense": (jax.jit(lambda x, w: gated_mlp(x, w[0], w[1], kernel=True)), (dense_gate_up, dense_down)),
        "all_experts": (jax.jit(all_experts), layer),
    }
    paths = [p for p in args.paths.split(",") if p in ("ragged_dot", "dense", "all_experts") or available()]
    if "q4_1" in paths:  # (quantizing takes a while: only when asked for)
        programs["q4_1"] = (jax.jit(moe_kernel), experts_as(q4_1))
    for kind in ("q4_0", "mxfp4"):  # random blocks, exact and packed for the integer mode
        if kind in paths or f"{kind}_integer" in paths:
            gtype = GGMLQuantizationType[kind.upper()]
            blocks = experts_as(lambda w: from_gguf(random_blocks(gtype, w.shape, w.ndim), gtype, w.shape).to_device())
            programs[kind] = (jax.jit(moe_kernel), blocks)
            programs[f"{kind}_integer"] = (jax.jit(moe_kernel), dataclasses.replace(
                blocks, w_experts_gate_up=pack_int8_experts(blocks.w_experts_gate_up),
                w_experts_down=pack_int8_experts(blocks.w_experts_down)))
            programs[f"{kind}_bytes"] = (jax.jit(moe_kernel), dataclasses.replace(  # codes widened to their values
                blocks, w_experts_gate_up=jax.device_get(blocks.w_experts_gate_up).widened().to_device(),
                w_experts_down=jax.device_get(blocks.w_experts_down).widened().to_device()))
    print(f"E={E} top-{k} hidden={D} expert_size={I}: experts {E * 3 * I * D * 4 / 2**20:.0f} MiB, "
          f"dense layer {3 * k * I * D * 4 / 2**20:.0f} MiB (float32); grouped kernel built: {available()}")
    print(f"{'rows':>5} " + " ".join(f"{p + ' ms':>15}" for p in paths) + "  ratios")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 1, D), np.float32))
        for name in paths:  # compile, and check the MoE paths agree with the all-experts reference
            run, params = programs[name]
            jax.block_until_ready(run(x, params))
        reference = np.asarray(programs["all_experts"][0](x, layer))
        for name in ("kernel", "ragged_dot"):
            if name in paths:
                np.testing.assert_allclose(np.asarray(programs[name][0](x, layer)), reference, atol=2e-4, rtol=2e-4)
        integer_error = {}  # the integer mode's distance to the exact mode on the same blocks, relative
        for kind in ("q4_0", "mxfp4"):
            if kind in paths and f"{kind}_integer" in paths:
                exact, integer = (np.asarray(programs[name][0](x, programs[name][1]))
                                  for name in (kind, f"{kind}_integer"))
                integer_error[kind] = float(np.linalg.norm(integer - exact) / np.linalg.norm(exact))
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for name in paths:
                run, params = programs[name]
                times[name].append(time_ms(run, x, params))
        ms = {p: statistics.median(t) for p, t in times.items()}
        moe_path = "kernel" if "kernel" in ms else "ragged_dot"
        ratios = []
        if "dense" in ms:
            ratios.append(f"{moe_path}/dense {ms[moe_path] / ms['dense']:.2f}x")
        if "all_experts" in ms:
            ratios.append(f"all_experts/{moe_path} {ms['all_experts'] / ms[moe_path]:.2f}x")
        if "ragged_dot" in ms and moe_path == "kernel":
            ratios.append(f"ragged_dot/kernel {ms['ragged_dot'] / ms['kernel']:.2f}x")
        if "int8" in ms and "int8_widened" in ms:
            ratios.append(f"int8_widened/int8 {ms['int8_widened'] / ms['int8']:.2f}x")
        if "mxfp4" in ms and "mxfp4_bytes" in ms:
            ratios.append(f"mxfp4_bytes/mxfp4 {ms['mxfp4_bytes'] / ms['mxfp4']:.2f}x")
        for kind, error in integer_error.items():
            ratios.append(f"{kind}/{kind}_integer {ms[kind] / ms[f'{kind}_integer']:.2f}x (error {error:.1e})")
        print(f"{rows:>5} " + " ".join(f"{ms[p]:>15.2f}" for p in paths) + "  " + ", ".join(ratios))


if __name__ == "__main__":
    main()
