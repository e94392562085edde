"""The random-weight checkpoint for accelerators loads as a Llama of the asked shape whose
tokenizer is the bundled model's: the same ids, special tokens and chat template."""

from __future__ import annotations

from raylm.benchmarks.random_checkpoint import export_tokenizer, write_random_checkpoint
from raylm.model.config.model_info import load_model_info
from raylm.model.config.registry import DEFAULT_MODEL
from raylm.model.loaders.load import load_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)


def test_checkpoint_has_the_shape_asked_and_the_bundled_tokenizer(tmp_path):
    tokenizer = export_tokenizer(tmp_path / "tokenizer")
    path = write_random_checkpoint(tmp_path / "checkpoint", tokenizer, TINY, dtype="float32")
    bundled, written = load_model_info(DEFAULT_MODEL), load_model_info(path)
    text = "The capital of France is Paris. <|im_end|>"
    assert written.tokenizer.encode(text) == bundled.tokenizer.encode(text)
    assert (written.tokenizer.bos_token_id, written.tokenizer.eos_token_ids) == (
        bundled.tokenizer.bos_token_id, bundled.tokenizer.eos_token_ids)
    chat = [{"role": "user", "content": "Hello"}]
    assert written.tokenizer.encode_chat(chat) == bundled.tokenizer.encode_chat(chat)
    config = load_model(path).config
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (2, 64, 2, 49152)
    assert config.tie_word_embeddings and set(config.eos_token_ids) == set(bundled.config.eos_token_ids)
