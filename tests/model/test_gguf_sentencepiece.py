"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``) tokenize as the HF
tokenizer they were made from.

The reference is a Llama-2-style HF tokenizer (BPE with byte fallback, ``▁`` for spaces and
one before the text, ``<unk> <s> </s>`` then the 256 byte pieces) trained here on a few
sentences. It is written into a GGUF as llama.cpp's converter writes a ``tokenizer.model``:
pieces in id order, SentencePiece's scores (minus the merge rank; 0 for special and byte
pieces) and token types; raylm rebuilds a tokenizer from those alone.
"""

from __future__ import annotations

import gguf
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

from raylm.model.config.model_info import load_tokenizer
from raylm.model.text.detokenizer import IncrementalDetokenizer

SPACE = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def main():\n    print('hello, world')\n\treturn 42\n",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Naïve café owners in Zürich serve crème brûlée — 日本語 too.",
]
TEXTS = [
    "Hello world",
    "  two leading spaces, then  double  spaces\nand a newline\n\n\ttab",
    "digits 31415926535 and 2026-11-26",
    "unicode: café naïve Zürich 日本語",
    "byte fallback: ☃ 🦙 ∮ and ǅ",  # none of these is in the vocabulary
    "special <s> inside </s> text",
    "",
]


def _reference(prefix: bool = True) -> Tokenizer:
    """A Llama-2-style tokenizer: specials, byte pieces, then the trained pieces in merge order."""
    spaces = normalizers.Replace(" ", SPACE)
    normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    model = trained.model
    pieces = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in _trained_merges(trained)]
    del model
    reference = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    reference.normalizer = normalizer
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    reference.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    reference.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return reference


def _trained_merges(tokenizer: Tokenizer) -> list[list[str]]:
    import json

    return json.loads(tokenizer.to_str())["model"]["merges"]


def _write_gguf(reference: Tokenizer, path, arch: str = "llama", prefix: bool = True) -> None:
    """The vocabulary as llama.cpp's _set_vocab_sentencepiece writes it (for Gemma, pieces are
    ranked by their place in the file and its pieces of spaces are user-defined tokens)."""
    vocab = reference.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types, scores = [], []
    for index, token in enumerate(tokens):
        if token in SPECIALS:
            types.append(gguf.TokenType.UNKNOWN if token == "<unk>" else gguf.TokenType.CONTROL)
            scores.append(0.0)
        elif token.startswith("<0x"):
            types.append(gguf.TokenType.BYTE)
            scores.append(0.0)
        elif arch.startswith("gemma") and len(token) > 1 and not token.strip(SPACE):
            # Gemma's pieces of spaces: user-defined, spelled with real spaces (llama.cpp's converter)
            tokens[index] = token.replace(SPACE, " ")
            types.append(gguf.TokenType.USER_DEFINED)
            scores.append(-1000.0)
        else:
            types.append(gguf.TokenType.NORMAL)
            scores.append(-float(index))  # SentencePiece BPE: later merges score lower
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,prefix", [("llama", True), ("gemma2", False)], ids=["llama2-style", "gemma-style"])
def test_encode_and_decode_match_the_hf_tokenizer(arch, prefix, tmp_path):
    reference = _reference(prefix)
    _write_gguf(reference, tmp_path / "vocab.gguf", arch, prefix)
    ours = load_tokenizer(tmp_path / "vocab.gguf")
    assert ours.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    assert ours.bos_token_id == 1 and 2 in ours.eos_token_ids
    for text in TEXTS:
        expected = reference.encode(text).ids
        assert ours.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == reference.decode(expected, skip)
    fallback = ours.encode("☃", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in fallback][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert ours.decode(ours.encode(TEXTS[4])) == TEXTS[4]


def test_streamed_text_is_the_decoded_text(tmp_path):
    """One token at a time (the router's streaming): byte-fallback pieces held back until
    their character is whole, the prefix space stripped once."""
    _write_gguf(_reference(), tmp_path / "vocab.gguf")
    tokenizer = load_tokenizer(tmp_path / "vocab.gguf")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        stream = IncrementalDetokenizer(tokenizer)
        pieces = [stream.add([i]) for i in ids] + [stream.finish()]
        assert "".join(pieces) == tokenizer.decode(ids)
        if "<s>" not in text:  # (a space goes before text after a special token, as in llama.cpp)
            assert "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_a_vocabulary_without_scores_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Exception, match="tokenizer.ggml.scores"):
        load_tokenizer(tmp_path / "v.gguf")
