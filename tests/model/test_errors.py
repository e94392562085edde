"""Bad checkpoints and requests raise errors that name the file, tensor and shapes involved."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file, save_file

from raylm.model.config.model_info import load_tokenizer
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import ModelLoadError, PromptTooLongError, UnsupportedModelError
from raylm.model.loaders.load import load_checkpoint, load_model, parse_dtype
from tests.checkpoints import build_tiny_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "ckpt")
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_name_or_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a known name .*smollm2-135m-instruct"):
        load_model(tmp_path / "does-not-exist")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty/config.json not found"):
        load_checkpoint(tmp_path / "empty")


def test_truncated_safetensors(checkpoint):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors.*truncated"):
        load_checkpoint(checkpoint)


def test_wrong_architecture(checkpoint):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*config.json.*LlamaForCausalLM"):
        load_checkpoint(checkpoint)


def test_missing_tensor(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.up_proj.weight' is missing \(expected shape \(128, 64\)\)"):
        load_checkpoint(checkpoint)


def test_shape_mismatch(checkpoint):
    _edit_config(checkpoint, intermediate_size=96)
    with pytest.raises(
        ModelLoadError, match=r"ckpt: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\), expected \(96, 64\)"
    ):
        load_checkpoint(checkpoint)


def test_unsupported_rope_scaling(checkpoint):
    _edit_config(checkpoint, rope_scaling={"rope_type": "dynamic", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'dynamic'"):
        load_checkpoint(checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_bias=True), r"attention_bias=true .* o_proj's \(gpt-oss\) only"),
        (dict(mlp_bias=True), "mlp_bias=true"),
        # (a factor leaving an odd number of dims to rotate: HF's rotate-half needs pairs)
        (dict(partial_rotary_factor=0.1), "partial_rotary_factor=0.1 .* rotates 1 of 16 dims"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
         "partial_rotary_factor=0.1"),
        (dict(hidden_act="relu2"), "MLP activation 'relu2'"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping .* only for Gemma"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
         "longrope RoPE .* needs original_max_position_embeddings"),
    ],
)
def test_unimplemented_config_options_are_refused(checkpoint, changes, message):
    """An option HF implements and raylm does not must fail the load, never fall back."""
    _edit_config(checkpoint, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_checkpoint(checkpoint)


def test_unknown_layer_type_is_refused(tmp_path):
    path, _ = build_tiny_checkpoint("qwen3", tmp_path / "q")
    _edit_config(path, layer_types=["full_attention", "chunked_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="layer_types .* chunked_attention"):
        load_checkpoint(path)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match=r"cannot read .*model.gguf as GGUF"):
        load_checkpoint(bad)


def test_missing_tokenizer(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        load_tokenizer(checkpoint)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        parse_dtype("float8")


def test_prompt_longer_than_context(checkpoint):
    generator = SingleSequenceGenerator(*load_checkpoint(checkpoint))
    with pytest.raises(PromptTooLongError, match=r"prompt has 600 tokens .* 610 in all, .* context is 512 tokens"):
        next(generator.generate([5] * 600, 10))
    with pytest.raises(PromptTooLongError, match="prompt has 500 tokens and 20 new tokens"):
        next(generator.generate([5] * 500, 20))
    with pytest.raises(ValueError, match="prompt is empty"):
        next(generator.generate([], 5))
