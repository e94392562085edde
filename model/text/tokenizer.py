"""Tokenizer: HF ``tokenizers`` from ``tokenizer.json``, or rebuilt from a GGUF's vocabulary.

Besides encode/decode it knows the special tokens, the full set of end-of-generation ids
(an instruct model may end a turn with ``<|im_end|>`` *or* ``<|endoftext|>``) and the chat
template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from raylm.model.errors import ModelLoadError, UnsupportedModelError
from raylm.model.text.chat_template import render_chat_template
from raylm.model.text.gguf_sentencepiece import sentencepiece_backend

# Tokens that end a turn in common chat formats; any present in the vocab joins the EOS set.
END_OF_GENERATION_TOKENS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>",
)
# gpt-oss's harmony format ends each message of a reply with <|end|> (the thoughts, then the
# answer): in a vocabulary with its <|channel|>, <|end|> does not end generation.
_HARMONY_CHANNEL, _MESSAGE_END = "<|channel|>", "<|end|>"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# o200k's split (gpt-oss's and Llama 4's tokenizer.json; llama.cpp's GPT4O pre-tokenizer).
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> the split regex each stands for (byte-level BPE after it).
_GGUF_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                "qwen2": _QWEN2_SPLIT, "gpt-4o": _O200K_SPLIT, "llama4": _O200K_SPLIT}


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for a GGUF ``tokenizer.ggml.pre`` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw_byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GGUF_SPLITS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"), raw_byte_level]
        )
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: default, gpt2, smollm, "
        f"{', '.join(_GGUF_SPLITS)}); "
        "use the model's HF directory with tokenizer.json instead"
    )


def _processor_chat_template(file: Path) -> str:
    """The template of a processor's ``chat_template.json`` (``{"chat_template": "..."}``)."""
    try:
        template = json.loads(file.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ModelLoadError(f"{file} is not a JSON object with a chat_template: {err}") from None
    if not isinstance(template, str):
        raise ModelLoadError(f"{file}: chat_template must be a string")
    return template


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        eos = [self.eos_token_id, *extra_eos_ids]
        harmony = backend.token_to_id(_HARMONY_CHANNEL) is not None
        eos += [backend.token_to_id(t) for t in END_OF_GENERATION_TOKENS if not (harmony and t == _MESSAGE_END)]
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids. Text that encodes to no tokens (empty, or only characters
        the vocabulary has no piece for, like most control characters) starts a new document
        instead, as OpenAI's completions do with an empty prompt: BOS, else the end-of-text
        token that separates documents. Empty only when the model has neither."""
        ids = self.encode(text)
        if ids:
            return ids
        start = self.bos_token_id if self.bos_token_id is not None else self.eos_token_id
        return [start] if start is not None else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for a conversation, as HF's ``apply_chat_template(tokenize=False)``."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        add_special_tokens: bool = False, **extra: Any,
    ) -> list[int]:
        """Token ids of a rendered conversation (the template itself places BOS, so no special
        tokens are added unless asked, as vLLM's ``/tokenize`` may); ``extra`` are more template
        variables (``tools``)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=add_special_tokens)

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` variable (else tools go in the system message)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja`` or a
        multimodal repo's ``chat_template.json``)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{file} not found: raylm needs a fast tokenizer (tokenizer.json)")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {file}: {err}") from None
        settings: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            settings = json.loads(config_file.read_text())
        template = settings.get("chat_template")
        if isinstance(template, list):  # named templates: HF picks "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file, processor_file = path / "chat_template.jinja", path / "chat_template.json"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is None and processor_file.is_file():  # multimodal repos: the processor's template
            template = _processor_chat_template(processor_file)
        return cls(
            backend,
            bos_token=_token_content(settings.get("bos_token")),
            eos_token=_token_content(settings.get("eos_token")),
            extra_eos_ids=extra_eos_ids,
            chat_template=template,
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str) -> "Tokenizer":
        """Rebuild the tokenizer llama.cpp would use from GGUF metadata: byte-level BPE
        (``tokenizer.ggml.model = gpt2``) or SentencePiece (``llama``: model/text/gguf_sentencepiece.py)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_backend(fields)
        elif kind == "llama":
            backend = sentencepiece_backend(fields, source)
        else:
            raise UnsupportedModelError(
                f"{source}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                "SentencePiece 'llama' are); use the model's HF directory with tokenizer.json instead"
            )
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])

        def token(key: str) -> str | None:
            index = fields.get(key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        # llama.cpp (and HF) add BOS to a SentencePiece vocabulary that does not say otherwise.
        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        add_bos = bos is not None and fields.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = eos is not None and fields.get("tokenizer.ggml.add_eos_token", False)
        if add_bos or add_eos:
            single, ends = "$A", []
            if add_bos:
                single, ends = f"{bos} {single}", [*ends, (bos, fields["tokenizer.ggml.bos_token_id"])]
            if add_eos:
                single, ends = f"{single} {eos}", [*ends, (eos, fields["tokenizer.ggml.eos_token_id"])]
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=f"{single} {single.replace('$A', '$B')}", special_tokens=ends
            )
        extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            extra_eos_ids=extra,
            chat_template=fields.get("tokenizer.chat_template"),
        )


def _byte_level_backend(fields: Mapping[str, Any]) -> BackendTokenizer:
    """A GGUF's byte-level BPE vocabulary and merges, with llama.cpp's pre-tokenizer."""
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control (special), 4 = user-defined (matched verbatim, decoded).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    return backend
