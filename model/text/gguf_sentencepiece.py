"""A GGUF's SentencePiece vocabulary (``tokenizer.ggml.model = llama``) as a ``tokenizers`` BPE.

Gemma, Llama 2 and Mistral v0.1 GGUFs carry SentencePiece's pieces, scores and token types,
not merges. llama.cpp tokenizes them by repeatedly joining the adjacent pair whose joined
piece scores highest, falling back to ``<0xNN>`` byte pieces for characters the vocabulary
lacks; that is BPE whose merges are every split of a piece into two pieces, ranked by the
piece's score, with byte fallback. HF's GGUF converters build the same (transformers'
integrations/gguf/gguf_tokenizer_mapping.py); so do we, with two of their choices: Gemma's
merges follow the order of its pieces in the file (its scores do not), and Gemma's pieces
of spaces, stored as real spaces, are spelled with ``▁`` like every other piece.

Spaces become ``▁`` and, with ``tokenizer.ggml.add_space_prefix`` (default true), one is
put before each stretch of text, as llama.cpp does at the start and after a special token.
"""

from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from raylm.model.errors import UnsupportedModelError

SPACE = "\u2581"
# GGUF token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_backend(fields: Mapping[str, Any], source: str) -> BackendTokenizer:
    """The tokenizer a GGUF's SentencePiece vocabulary describes (special tokens added)."""
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    gemma = str(fields.get("general.architecture", "")).startswith("gemma")
    if gemma:  # pieces of spaces (user-defined in the file) become pieces of ``▁`` merges can form
        spaces = [bool(t) and not t.strip(" ") for t in tokens]
        tokens = [SPACE * len(t) if s else t for t, s in zip(tokens, spaces)]
        types = [NORMAL if s else k for k, s in zip(types, spaces)]
        scores = [-float(i) for i in range(len(tokens))]
    elif "tokenizer.ggml.scores" in fields:
        scores = [float(s) for s in fields["tokenizer.ggml.scores"]]
    else:
        raise UnsupportedModelError(f"{source}: a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores")
    if not len(tokens) == len(types) == len(scores):
        raise UnsupportedModelError(f"{source}: {len(tokens)} tokens, {len(types)} token types, {len(scores)} scores")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = fields.get("tokenizer.ggml.unknown_token_id", next((i for i, k in enumerate(types) if k == UNKNOWN), None))
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(tokens, types, scores, vocab),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=BYTE in types,
        )
    )
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return backend


def _merges(tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, best piece score first (ties: the longer
    left part first, then by the parts' ids, as HF's ``generate_merges``)."""
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for token, kind, score in zip(tokens, types, scores):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
