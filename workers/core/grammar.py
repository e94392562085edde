"""Structured output: a grammar that a sequence's tokens must follow (a JSON schema, any JSON
object, a regular expression, one of a list of choices, or a Lark / GBNF grammar).

llguidance (a well-kept Rust engine with numpy bindings, no torch or transformers) compiles
the grammar against the model's tokenizer and, before every sampled token, fills the row's
bitmask of allowed tokens (workers/runner/grammar_masks.py); the batched sampler masks the
logits with it (workers/runner/sampler.py),
so constrained and free rows share a batch. After each sampled token the sequence's matcher
consumes it (workers/core/output_builder.py); once the grammar cannot be extended the sequence
finishes with ``stop``.

Compiling (about a millisecond for a realistic schema, more for large grammars) happens once
per distinct grammar, off the engine thread where a server calls ``prepare`` first; each
sequence then gets its own copy of the compiled matcher.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import llguidance

    from raylm.model.text.tokenizer import Tokenizer

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON without free whitespace: with it, small models (and random logits) loop on blanks and
# never close the object; OpenAI's and vLLM's outputs look like this too.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message says why (a client error: HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. ``spec``: the JSON schema (as JSON text), the regex,
    the choices (as a JSON list) or the grammar text; None for ``json_object``."""

    kind: Kind
    spec: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "json_object") != (self.spec is None):
            raise ValueError(f"structured output {self.kind} {'takes no' if self.kind == 'json_object' else 'needs a'} spec")
        if self.spec is not None and not isinstance(self.spec, str):
            raise ValueError("structured output spec must be text")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """The schema as given, key order included: llguidance writes an object's properties in
        the order the schema lists them (as OpenAI's strict mode does), so sorting the keys here
        would reorder the output."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))


class GrammarCompiler:
    """Compiles ``StructuredOutput``s for one tokenizer and hands each sequence its own matcher.

    Thread-safe: a server compiles in worker threads (``prepare``) while the engine thread
    takes copies (``matcher``). Compiled grammars are kept for the most recent
    ``MAX_CACHED_GRAMMARS`` distinct specs.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        primary = getattr(tokenizer, "eos_token_id", None)
        self._eos_ids = sorted(eos_ids, key=lambda i: (i != primary, i))  # the primary EOS first
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._templates: collections.OrderedDict[StructuredOutput, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, output: StructuredOutput) -> None:
        """Compile ``output`` unless cached; raises GrammarError naming the problem."""
        self._template(output)

    def matcher(self, output: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (compiling first if ``prepare`` was not called)."""
        template = self._template(output)
        with self._lock:
            return template.deep_copy()

    def _template(self, output: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(output)
            if template is not None:
                self._templates.move_to_end(output)
                return template
        import llguidance

        template = llguidance.LLMatcher(self._tokenizer_for_llguidance(), _grammar(output), log_level=0)
        if template.is_error():
            raise GrammarError(_problem(output, template.get_error()))
        with self._lock:
            self._templates[output] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def _tokenizer_for_llguidance(self) -> llguidance.LLTokenizer:
        """Built once (a few hundred ms: llguidance indexes the whole vocabulary)."""
        if self._tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer, and this model has none")
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
            return self._ll_tokenizer


def _grammar(output: StructuredOutput) -> str:
    """llguidance's grammar text for ``output``; malformed input is a GrammarError."""
    import llguidance

    try:
        match output.kind:
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
            case "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(output.spec, overrides=JSON_LAYOUT)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(output.spec)
            case "choice":
                return llguidance.grammar_from("choice", output.spec)
            case "grammar":
                return llguidance.grammar_from("grammar", output.spec)
    except ValueError as err:
        raise GrammarError(_problem(output, str(err))) from None
    raise AssertionError(output.kind)


def _problem(output: StructuredOutput, error: str) -> str:
    """One line (HTTP errors show one), bounded: llguidance's messages quote the grammar."""
    return f"the {output.kind.replace('_', ' ')} cannot be used: {' '.join(error.split())}"[:600]
