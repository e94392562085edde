"""gpt-oss's MXFP4 experts kept as stored: the widened weights are transformers' dequantization bit
for bit, and a tiny checkpoint written as the openai release writes it (experts as ``*_blocks`` /
``*_scales``, ``quantization_config`` mxfp4) gives HF's logits and greedy tokens on the
dequantized weights, through the reference loop and the engine (the grouped kernel on blocks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_checkpoint, load_model
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.mxfp4 import hf_mxfp4_blocks
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy


def _random_mxfp4(shape: tuple[int, ...], rng: np.random.Generator, exponents: tuple[int, int]):
    """Random codes and e8m0 scales for a ``[..., out, in]`` tensor, in HF's layout."""
    *lead, size = shape
    blocks = rng.integers(0, 256, size=(*lead, size // 32, 16), dtype=np.uint8)
    scales = rng.integers(*exponents, size=(*lead, size // 32), dtype=np.uint8)
    return blocks, scales


def _transformers(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return theirs.transpose(1, 2).numpy()  # transformers returns [E, in, out]


def test_widened_values_are_transformers_dequantization():
    """Every code and every scale byte from 2 (2^-126, float32's smallest normal) to 255 (where
    6 * 2^128 overflows to inf on both sides): bit for bit, but for the sign of zero (code 8 is
    -0, held as the integer 0: a product or sum with it is the same number)."""
    rng = np.random.default_rng(0)
    blocks, scales = _random_mxfp4((3, 256, 8 * 32), rng, (2, 256))
    scales.reshape(-1)[:254] = np.arange(2, 256, dtype=np.uint8)
    ours = np.asarray(hf_mxfp4_blocks(blocks, scales).dequantize())  # [E, out, in]
    theirs = _transformers(blocks, scales)
    nonzero = theirs != 0
    assert np.isinf(theirs).any() and nonzero.mean() > 0.8
    np.testing.assert_array_equal(ours[nonzero].view(np.uint32), theirs[nonzero].view(np.uint32))
    assert not ours[~nonzero].any()


def test_subnormal_scales_read_as_zero():
    """Scale bytes 0 and 1 (2^-128, 2^-127: float32 subnormals) give weights of at most 6 * 2^-126 that
    XLA's CPU flushes to zero, as it flushes every subnormal; transformers keeps them."""
    rng = np.random.default_rng(3)
    blocks, scales = _random_mxfp4((1, 4, 64), rng, (0, 2))
    ours = np.asarray(hf_mxfp4_blocks(blocks, scales).dequantize())
    assert not ours.any() and np.abs(_transformers(blocks, scales)).max() == np.float32(6 * 2.0**-126)


def _mxfp4_checkpoint(tmp_path):
    """The tiny gpt-oss with its experts replaced by random MXFP4 ones, written as the release
    writes them; and the HF model holding their dequantization (the reference)."""
    path, hf_model = build_tiny_checkpoint("gpt-oss", tmp_path / "float")
    rng = np.random.default_rng(1)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for name, param in hf_model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, size, out = param.shape
            blocks, scales = _random_mxfp4((E, out, size), rng, (120, 126))
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(state[name + "_blocks"], state[name + "_scales"],
                                                       dtype=torch.float32))
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    save_file(state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (packed / extra).write_bytes((path / extra).read_bytes())
    return packed, hf_model


@pytest.mark.parametrize("keep_blocks", [True, False], ids=["kept", "expanded"])
def test_mxfp4_checkpoint_gives_hf_logits_on_the_dequantized_weights(tmp_path, keep_blocks):
    path, hf_model = _mxfp4_checkpoint(tmp_path)
    config, params = load_checkpoint(path, keep_blocks=keep_blocks)
    assert isinstance(params.layers[0].w_experts_gate_up, GgufBlocks) == keep_blocks
    ids = np.random.RandomState(2).randint(3, 320, size=40).tolist()
    generator = SingleSequenceGenerator(config, params)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, 16)) == hf_greedy(hf_model, ids, 16)


def test_mxfp4_experts_through_the_engine(tmp_path):
    """The engine on one CPU device keeps the experts as blocks (the grouped kernel widens them)."""
    path, hf_model = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, keep_blocks=True)
    assert isinstance(model.params.layers[0].w_experts_down, GgufBlocks)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (5, 30, 70)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = LLM(model, max_model_len=128, num_kv_blocks=64).generate([{"prompt_token_ids": p} for p in prompts],
                                                                        greedy)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in prompts]
