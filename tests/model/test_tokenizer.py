"""Our GGUF-built tokenizer and chat template against HF transformers on the same file."""

from __future__ import annotations

import random

import pytest

BASE_STRINGS = [
    "Hello, world!", "The capital of France is", "  leading spaces", "trailing spaces   ",
    "tabs\tand\ttabs", "line\nbreaks\n\nand\r\nCRLF", "many     spaces      here", "\n\n\n", " ",
    "numbers 1234567890 and 3.14159 and 1,000,000", "phone +1 (555) 010-9999", "year 2024-11-22T10:00:00Z",
    "x1y2z3", "v0.10.2", "0x1F600", "1e-5", "¡Hola! ¿Qué tal? Ça va très bien, merci.",
    "Größe, Straße, naïve café, résumé", "Привет, как дела?", "こんにちは世界、元気ですか？",
    "你好，世界！我们今天学习编程。", "안녕하세요 세계", "مرحبا بالعالم", "नमस्ते दुनिया", "Γειά σου Κόσμε",
    "emoji 😀😃😄 and 👍🏽 thumbs", "family 👨‍👩‍👧‍👦 zwj", "flags 🇫🇷🇩🇪🇯🇵", "math ∑∫√∞ ≤ ≥ ≠", "arrows ← → ↑ ↓",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}', "<html><body><p>Hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;", "import numpy as np\nnp.zeros((3, 4))", "$ ls -la | grep '.py'",
    "it's they're we've I'm you'll he'd", "IT'S THEY'RE", "don't   stop", "a\u00a0non-breaking space",
    "zero\u200bwidth", "<|im_start|>user\nhi<|im_end|>", "text<|endoftext|>more text", "<repo_name>raylm",
    "<|im_start|><|im_end|><|endoftext|>", "<|im_start", "im_end|>", "<filename>main.py<file_sep>",
    "URL https://example.com/path?q=1&r=2#frag", "email someone@example.org", "C:\\Users\\name\\file.txt",
    "~!@#$%^&*()_+-=[]{}|;':\",./<>?", "ALLCAPS lowercase MiXeD", "repeated aaaaaaaaaaaaaaaaaaaaaaa",
    "....!!!???", "— en–dash … ellipsis “quotes” ‘single’", "tab\t\t\tindent", "\tstarts with tab",
]


def _varied_strings(count: int = 220) -> list[str]:
    """The base strings plus deterministic random joins of them (varied boundaries)."""
    rng = random.Random(1234)
    joins = ["", " ", "\n", "  ", "\t", ". "]
    out = list(BASE_STRINGS)
    while len(out) < count:
        pieces = rng.sample(BASE_STRINGS, rng.randint(2, 4))
        out.append(rng.choice(joins).join(pieces))
    return out


@pytest.mark.parametrize("text", _varied_strings())
def test_ids_equal_hf(bundled_model, hf_bundled_tokenizer, text):
    ours = bundled_model.tokenizer.encode(text)
    assert ours == hf_bundled_tokenizer(text)["input_ids"]
    assert bundled_model.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_are_isolated_before_byte_level(bundled_model):
    """Hand-checked against llama.cpp's "smollm" pre-tokenizer: digits split off first."""
    tok = bundled_model.tokenizer
    ids = tok.encode("a  1")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("x 42")] == ["x", "Ġ", "4", "2"]


def test_special_tokens(bundled_model):
    tok = bundled_model.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with émojis 🎨?"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_hf(bundled_model, hf_bundled_tokenizer, messages, add_generation_prompt):
    ours = bundled_model.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    reference = hf_bundled_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == reference
    assert bundled_model.tokenizer.encode_chat(messages, add_generation_prompt) == hf_bundled_tokenizer(
        reference, add_special_tokens=False
    )["input_ids"]


def test_chat_template_raise_exception():
    from raylm.model.text.chat_template import ChatTemplateError, render_chat_template

    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat_template("{% if %}", [])


def test_end_ends_generation_except_in_harmony_vocabularies():
    """Phi-3's <|end|> ends a reply; gpt-oss's ends each message of one (the thoughts, then the
    answer), so a vocabulary with harmony's <|channel|> keeps generating past it."""
    from tokenizers import AddedToken

    from raylm.model.text.tokenizer import Tokenizer
    from tests.checkpoints import tiny_tokenizer

    phi, harmony = tiny_tokenizer(), tiny_tokenizer()
    phi.add_special_tokens([AddedToken("<|end|>", special=True)])
    harmony.add_special_tokens([AddedToken(t, special=True) for t in ("<|end|>", "<|channel|>", "<|return|>")])
    assert phi.token_to_id("<|end|>") in Tokenizer(phi, bos_token="<s>", eos_token="</s>").eos_token_ids
    ids = Tokenizer(harmony, bos_token="<s>", eos_token="<|return|>").eos_token_ids
    assert harmony.token_to_id("<|end|>") not in ids and harmony.token_to_id("<|return|>") in ids
