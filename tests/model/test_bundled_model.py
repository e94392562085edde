"""The bundled SmolLM2 GGUF (Q4_1, dequantized) against HF transformers reading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.model.decoder.generate import SingleSequenceGenerator
from tests.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("optimized_xla")  # runtime-heavy: see tests/conftest.py


@pytest.fixture(scope="module")
def generator(bundled_model):
    return SingleSequenceGenerator(bundled_model.config, bundled_model.params)


def test_config_read_from_gguf(bundled_model):
    c = bundled_model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.rope_theta) == (49152, 64, 1536, 100000.0)
    assert c.tie_word_embeddings and bundled_model.params.lm_head is None
    tok = bundled_model.tokenizer
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= set(c.eos_token_ids)


@pytest.mark.parametrize(
    "prompt,chat",
    [
        ("The capital of France is", False),
        ("Write a short poem about the sea, then explain its meter line by line.", True),
    ],
)
def test_logits_and_greedy_continuation_match_hf(bundled_model, hf_bundled_model, generator, prompt, chat):
    tok = bundled_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    ours = generator.prompt_logits(ids)
    with torch.no_grad():
        reference = hf_bundled_model(torch.tensor([ids])).logits[0].numpy()
    # float32 through 30 layers: differences are summation-order noise on logits of size ~30.
    assert np.abs(ours - reference).max() < 2e-3 * np.abs(reference).max()
    assert (ours.argmax(-1) == reference.argmax(-1)).all()

    assert list(generator.generate(ids, 32)) == hf_greedy(hf_bundled_model, ids, 32)


def test_paris(bundled_model, generator):
    tok = bundled_model.tokenizer
    out = generator.generate(tok.encode("The capital of France is"), 8)
    assert "Paris" in tok.decode(list(out))
