"""The text decoder of a multimodal checkpoint (Llama 4, Gemma 3, Mistral 3, LLaVA, Qwen VL and
Qwen3-VL-MoE) served alone: logits and greedy tokens equal HF's wrapper on text input, in either
layout of tensor names transformers has written and either layout of stacked experts, and
unsupported decoders are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.load import load_checkpoint
from raylm.model.loaders.text_decoder_names import text_decoder_names
from tests.multimodal_checkpoints import (
    MULTIMODAL_VARIANTS,
    build_tiny_multimodal_checkpoint,
    resave_with_transformers_4_names,
)
from tests.reference import hf_greedy

FAMILY = {"llama4": "Llama4ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM",
          "llava-qwen2": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM",
          "qwen3_vl_moe": "Qwen3MoeForCausalLM"}


def _prompt() -> list[int]:
    return np.random.RandomState(0).randint(3, 320, size=40).tolist()


@pytest.mark.parametrize("variant", MULTIMODAL_VARIANTS)
def test_text_decoder_matches_hf_wrapper(variant, tmp_path):
    path, hf_model = build_tiny_multimodal_checkpoint(variant, tmp_path / variant)
    config, params = load_checkpoint(path)
    assert config.architecture == FAMILY[variant]
    generator = SingleSequenceGenerator(config, params)
    ids = _prompt()
    with torch.no_grad():
        reference = hf_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, 16)) == hf_greedy(hf_model, ids, 16)


@pytest.mark.parametrize("variant", ["llama4", "gemma3"])  # an untied LM head, and a tied one
def test_transformers_4_layout_loads_the_same_weights(variant, tmp_path):
    path, _ = build_tiny_multimodal_checkpoint(variant, tmp_path / variant)
    config, hub_layout = load_checkpoint(path)
    resave_with_transformers_4_names(path)
    assert config == load_checkpoint(path)[0]
    older = load_checkpoint(path)[1]
    for a, b in zip(jax_leaves(hub_layout), jax_leaves(older), strict=True):
        np.testing.assert_array_equal(a, b)


def test_qwen3_vl_moe_experts_as_released_load_the_same_weights(tmp_path):
    """transformers 5 saves Qwen3-VL-MoE's stacked experts outputs first; the released checkpoints
    hold them inputs first (``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]``)."""
    from safetensors.numpy import load_file, save_file

    path, _ = build_tiny_multimodal_checkpoint("qwen3_vl_moe", tmp_path / "m")
    saved = load_checkpoint(path)[1]
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    released = {name: np.ascontiguousarray(a.transpose(0, 2, 1)) if ".mlp.experts." in name else a
                for name, a in tensors.items()}
    assert released["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 48)
    save_file(released, str(file), metadata={"format": "pt"})
    for a, b in zip(jax_leaves(saved), jax_leaves(load_checkpoint(path)[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_square_stacked_experts_take_their_layout_from_the_other_tensor():
    """D = 2I makes ``gate_up_proj`` read the same either way round; ``down_proj`` then tells."""
    from raylm.model.loaders.fused_experts import fused_expert_projection

    E, D, I = 3, 8, 4
    rng = np.random.RandomState(0)
    gate, up, down = rng.randn(E, I, D), rng.randn(E, I, D), rng.randn(E, D, I)  # [E, out, in]
    layouts = {
        "released": {"experts.gate_up_proj": np.concatenate([gate, up], 1).transpose(0, 2, 1),
                     "experts.down_proj": down.transpose(0, 2, 1)},
        "transformers 5": {"experts.gate_up_proj": np.concatenate([gate, up], 1), "experts.down_proj": down},
    }
    for stored in layouts.values():
        got = {p: fused_expert_projection(stored.get, "", p, D, I) for p in ("gate_proj", "up_proj", "down_proj")}
        for proj, want in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            np.testing.assert_array_equal(got[proj], want)
    with pytest.raises(Exception, match=r"expected \[E, 4, 8\] or \[E, 8, 4\]"):
        fused_expert_projection({"experts.down_proj": down[:, :, :3]}.get, "", "down_proj", D, I)


def jax_leaves(params) -> list[np.ndarray]:
    import jax

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(params)]


def test_a_qwen2_5_vl_config_from_before_text_config_reads_alike(tmp_path):
    """Qwen2.5-VL's released config.json: the decoder's keys at the top level, M-RoPE as
    ``rope_scaling: {"type": "mrope"}``."""
    path, _ = build_tiny_multimodal_checkpoint("qwen2_5_vl", tmp_path / "m")
    nested = json.loads((path / "config.json").read_text())
    raw = dict(nested)
    text = raw.pop("text_config")
    flat = {**{k: v for k, v in text.items() if k not in ("rope_parameters", "model_type")}, **raw,
            "model_type": "qwen2_5_vl", "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    assert ModelConfig.from_hf_dict(flat) == ModelConfig.from_hf_dict(nested)
    assert ModelConfig.from_hf_dict(nested).rope_scaling is None  # (1-D RoPE on text)


def test_vision_tensors_are_not_decoder_tensors():
    stored = ["language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight",
              "vision_model.model.layers.0.mlp.fc1.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight",
              "multi_modal_projector.linear_1.weight", "model.vision_tower.patch_conv.weight"]
    assert text_decoder_names(stored) == {
        "model.layers.0.mlp.up_proj.weight": "language_model.model.layers.0.mlp.up_proj.weight",
        "lm_head.weight": "language_model.lm_head.weight",
    }


def test_unsupported_text_decoder_is_refused_by_name(tmp_path):
    path, _ = build_tiny_multimodal_checkpoint("llava-qwen2", tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["model_type"] = "phi"
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration's text decoder is 'phi'"):
        ModelConfig.from_hf_dict(raw)
    del raw["text_config"]
    with pytest.raises(Exception, match="without a text_config"):
        ModelConfig.from_hf_dict(raw)


def test_processor_chat_template_is_read_when_the_tokenizer_has_none(tmp_path):
    from raylm.model.errors import ModelLoadError
    from raylm.model.text.tokenizer import Tokenizer

    path, _ = build_tiny_multimodal_checkpoint("gemma3", tmp_path / "m")
    processor = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    tokenizer = Tokenizer.from_hf_dir(path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<start_of_turn>user\nhi<end_of_turn>\n"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "own"}))
    assert Tokenizer.from_hf_dir(path).chat_template == "own"  # the tokenizer's own wins, as in HF
    (path / "tokenizer_config.json").write_text("{}")
    (path / "chat_template.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="chat_template.json"):
        Tokenizer.from_hf_dir(path)
