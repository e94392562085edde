"""Validate OpenAI chat / completions request bodies into token ids and ``SamplingParams``.

Every check names the offending field (OpenAI's ``param``) so a client can fix its request;
unknown fields are refused like OpenAI does, fields raylm does not implement are refused by
name rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Literal, Mapping

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.chat_messages import parse_messages
from raylm.router.chat_options import template_variables
from raylm.router.errors import OpenAIError, invalid
from raylm.router.reasoning import ThoughtsStart, reasoning_parser_for, thoughts_start
from raylm.router.reasoning_grammar import params_after_thoughts
from raylm.router.structured_request import structured_output
from raylm.router.tool_format_harmony import HarmonyFormat
from raylm.router.tool_parsers import ToolFormat, check_template_renders_tools, params_for_calls, tool_format
from raylm.router.tools import ToolUse, parse_tool_use, template_messages
from raylm.workers.core.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    BeamSearchParams,
    SamplingParams,
    SamplingParamsError,
)

MAX_N = 16
MAX_STOP_SEQUENCES = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default

_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "stream", "stream_options", "user", "logit_bias",
    # extensions (vLLM's names)
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "priority", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "response_format",
    # structured output, vLLM's names
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    # beam search, vLLM's names (the beam width is n)
    "use_beam_search", "length_penalty",
}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "store", "metadata", "service_tier", "reasoning_effort", "modalities",
    "chat_template_kwargs",  # vLLM's: more chat template variables (e.g. enable_thinking)
    "thinking_token_budget",  # vLLM's: the most tokens the thoughts may take (router/reasoning_grammar.py)
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {
    "prompt", "logprobs", "echo", "suffix", "best_of",
    # hidden-state extraction (workers/core/hidden_states.py), raylm's extension
    "return_hidden_states", "hidden_states_include_prompt",
}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "priority"}
# vLLM's /tokenize (a prompt, or chat messages) and /detokenize; ``model`` is optional there
_TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {"model", "messages", "tools", "add_generation_prompt", "add_special_tokens",
                         "return_token_strs", "continue_final_message", "chat_template", "chat_template_kwargs"}
_DETOKENIZE_FIELDS = {"model", "tokens"}
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit
_UNSUPPORTED_IF_SET = {"suffix", "modalities", "functions"}


@dataclasses.dataclass
class ParsedRequest:
    """A validated request, ready for the worker replicas."""

    kind: Literal["chat", "completion", "embedding"]
    model: str
    prompts: list[list[int]]  # one engine request per prompt (completions may send several)
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-N logprobs per token, None when not asked
    echo: bool
    user: str | None
    priority: str | int | None  # a priority class name or index; the router maps it
    tool_use: ToolUse | None = None  # chat: the tools the model may call
    tool_format: ToolFormat | None = None  # chat with tools: how the model writes calls (router/tool_formats.py)
    thoughts: ThoughtsStart | None = None  # chat with a reasoning model: how its reply begins
    encoding_format: str = "float"  # embeddings: "float" or "base64"
    beam: BeamSearchParams | None = None  # use_beam_search: n beams instead of n samples


class RequestParser:
    """Turns JSON bodies into ``ParsedRequest`` for one served model."""

    def __init__(self, tokenizer: Tokenizer, served_model_names: Collection[str], max_model_len: int,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        """``served_model_names`` may be a live view (adapters loaded at run time join it); ``auto``
        parsers: the chat template's (router/tool_parsers.py, router/reasoning.py)."""
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.tool_format = tool_format(tool_call_parser, tokenizer)
        self.reasoning_parser = reasoning_parser_for(reasoning_parser, tokenizer.chat_template, self.tool_format.name)

    def parse_chat(self, body: Any) -> ParsedRequest:
        body = _require_object(body)
        _refuse_unknown(body, _CHAT_FIELDS)
        model = self._model(body)
        tool_use = parse_tool_use(body)
        prompt_text, prompt_ids = self._chat_prompt(body, tool_use)
        want_logprobs = _optional(body, "logprobs", bool)
        top = _optional(body, "top_logprobs", int)
        if top is not None and not want_logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        logprobs = (top or 0) if want_logprobs else None
        max_tokens = _optional(body, "max_completion_tokens", int)
        max_tokens = _optional(body, "max_tokens", int) if max_tokens is None else max_tokens
        parsed = self._finish(body, "chat", model, [prompt_ids], [None], max_tokens, logprobs, echo=False)
        if tool_use is not None:
            parsed.params = params_for_calls(self.tool_format, tool_use, parsed.params)
            parsed.tool_use, parsed.tool_format = tool_use, self.tool_format
        parsed.thoughts = thoughts_start(self.reasoning_parser, prompt_text)
        harmony = self.tool_format if isinstance(self.tool_format, HarmonyFormat) else None
        parsed.params = params_after_thoughts(parsed.params, parsed.thoughts, tool_use, self.tokenizer,
                                              _optional(body, "thinking_token_budget", int), harmony)
        if parsed.beam is not None and tool_use is not None:
            raise invalid("use_beam_search cannot be combined with tools", "use_beam_search")
        return parsed

    def _chat_prompt(self, body: Mapping[str, Any], tool_use: ToolUse | None, add_generation_prompt: bool = True,
                     add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The conversation's prompt text and ids: its messages (and tools, and the request's
        template variables) through the chat template."""
        takes_tools = self.tokenizer.chat_template_takes_tools
        check_template_renders_tools(self.tool_format, tool_use, takes_tools)
        history = self.tool_format.history(parse_messages(body.get("messages")))
        messages, extra = template_messages(history, tool_use, takes_tools)
        variables = template_variables(body, self.tokenizer.chat_template)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **variables, **extra)
        except Exception as err:  # a template may raise on odd role orders
            raise invalid(f"cannot render the chat template for these messages: {err}", "messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def parse_completion(self, body: Any) -> ParsedRequest:
        body = _require_object(body)
        _refuse_unknown(body, _COMPLETION_FIELDS)
        model = self._model(body)
        prompts, texts = self._prompts(body.get("prompt", _MISSING))
        logprobs = _optional(body, "logprobs", int)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        echo = bool(_optional(body, "echo", bool))
        if echo and logprobs is not None:
            raise invalid("echo together with logprobs is not supported", "echo")
        best_of = _optional(body, "best_of", int)
        if best_of not in (None, 1) and best_of != body.get("n", 1):
            raise invalid("best_of other than n is not supported", "best_of")
        max_tokens = _optional(body, "max_tokens", int)
        if max_tokens is None:  # absent or null: OpenAI's legacy default, not the rest of the context
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        return self._finish(body, "completion", model, prompts, texts, max_tokens, logprobs, echo)

    def parse_embedding(self, body: Any) -> ParsedRequest:
        """``/v1/embeddings``: ``input`` as a string, strings, token ids or lists of them."""
        body = _require_object(body)
        _refuse_unknown(body, _EMBEDDING_FIELDS)
        model = self._model(body)
        prompts, texts = self._prompts(body.get("input", _MISSING), "input")
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise invalid(f"input may hold at most {MAX_EMBEDDING_INPUTS} items, got {len(prompts)}", "input")
        encoding_format = _optional(body, "encoding_format", str) or "float"
        if encoding_format not in ("float", "base64"):
            raise invalid(f"encoding_format must be float or base64, got {encoding_format!r}"[:300], "encoding_format")
        if _optional(body, "dimensions", int) is not None:
            raise invalid("dimensions is not supported: embeddings have the model's hidden size", "dimensions")
        self._check_context(prompts, None, "input")
        priority = body.get("priority")
        if priority is not None and not (isinstance(priority, str) or _is_int(priority)):
            raise invalid("priority must be a priority class name or index", "priority")
        return ParsedRequest(
            kind="embedding", model=model, prompts=prompts, prompt_texts=texts,
            params=SamplingParams(max_tokens=1, temperature=0), stream=False, include_usage=False, logprobs=None,
            echo=False, user=_optional(body, "user", str), priority=priority, encoding_format=encoding_format,
        )

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/tokenize`` answer: a ``prompt`` encoded as completions encode it, or
        ``messages`` (and ``tools``) rendered and encoded as chat completions do, so ``count`` is
        what a request would use of ``max_model_len``."""
        body = _require_object(body)
        chat = "messages" in body
        _refuse_unknown(body, _TOKENIZE_CHAT_FIELDS if chat else _TOKENIZE_FIELDS)
        if body.get("model") is not None:
            self._model(body)
        add_special_tokens = _optional(body, "add_special_tokens", bool)
        if chat:
            for field in ("continue_final_message", "chat_template"):
                if body.get(field) not in (None, False, {}):
                    raise invalid(f"{field} is not supported by this server", field)
            add_generation_prompt = _optional(body, "add_generation_prompt", bool)
            _, ids = self._chat_prompt(body, parse_tool_use(body), add_generation_prompt is not False,
                                       bool(add_special_tokens))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                raise invalid("you must provide a prompt parameter (or messages, to tokenize a conversation)", "prompt")
            if not isinstance(prompt, str):
                raise invalid("prompt must be a string (send messages instead to tokenize a conversation)", "prompt")
            # As a completion encodes it (an empty prompt starts a new document), unless the
            # caller asks for the bare text's ids.
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if add_special_tokens is False \
                else self.tokenizer.encode_prompt(prompt)
        strings = [self.tokenizer.id_to_token(i) for i in ids] if _optional(body, "return_token_strs", bool) else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strings}

    def detokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize`` answer: the text of ``tokens``, special tokens included."""
        body = _require_object(body)
        _refuse_unknown(body, _DETOKENIZE_FIELDS)
        if body.get("model") is not None:
            self._model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise invalid("tokens must be a list of token ids", "tokens")
        self._check_in_vocabulary(tokens, "tokens", "token ids")
        return {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)}

    # -- shared -------------------------------------------------------------------------------------
    def _model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            raise invalid("you must provide a model parameter", "model")
        if not isinstance(model, str):
            raise invalid("model must be a string", "model")
        if model not in self.served_model_names:
            raise OpenAIError(
                404, f"The model '{model}' does not exist; this server serves {list(self.served_model_names)}",
                param="model", code="model_not_found",
            )
        return model

    def _check_in_vocabulary(self, ids: list[int], param: str, what: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})", param)

    def _prompts(self, prompt: Any, param: str = "prompt") -> tuple[list[list[int]], list[str | None]]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists."""
        if prompt is _MISSING:
            raise invalid(f"you must provide a{'n' if param[0] in 'aeiou' else ''} {param} parameter", param)
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                      or all(isinstance(p, list) for p in prompt)):
            items = prompt
        else:
            raise invalid(f"{param} must be a string, a list of strings, a list of token ids or a list of those", param)
        ids, texts = [], []
        for item in items:
            if isinstance(item, str):
                ids.append(self.tokenizer.encode_prompt(item))
                texts.append(item)
            else:
                if not item or not all(_is_int(t) for t in item):
                    raise invalid(f"a token-id {param} must be a non-empty list of integers", param)
                self._check_in_vocabulary(item, param, f"{param} token ids")
                ids.append(list(item))
                texts.append(None)
        if any(not p for p in ids):
            raise invalid(f"the {param} is empty: give at least one token", param)
        return ids, texts

    def _finish(
        self,
        body: Mapping[str, Any],
        kind: Literal["chat", "completion", "embedding"],
        model: str,
        prompts: list[list[int]],
        texts: list[str | None],
        max_tokens: int | None,
        logprobs: int | None,
        echo: bool,
    ) -> ParsedRequest:
        for field in _UNSUPPORTED_IF_SET:
            if body.get(field) not in (None, [], {}):
                raise invalid(f"{field} is not supported by this server", field)
        stream = bool(_optional(body, "stream", bool))
        stream_options = _optional(body, "stream_options", dict)
        if stream_options is not None and not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = bool(_optional(stream_options or {}, "include_usage", bool, "stream_options.include_usage"))
        n = _optional(body, "n", int)
        if n is not None and not 1 <= n <= MAX_N:
            raise invalid(f"n must be in [1, {MAX_N}], got {n}", "n")
        if max_tokens is not None and max_tokens < 1:
            raise invalid(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        self._check_context(prompts, max_tokens, "messages" if kind == "chat" else "prompt")
        params = self._sampling_params(body, n or 1, max_tokens, logprobs)
        user = _optional(body, "user", str)
        priority = body.get("priority")
        if priority is not None and not (isinstance(priority, str) or _is_int(priority)):
            raise invalid("priority must be a priority class name or index", "priority")
        return ParsedRequest(
            kind=kind, model=model, prompts=prompts, prompt_texts=texts, params=params, stream=stream,
            include_usage=include_usage, logprobs=logprobs, echo=echo, user=user, priority=priority,
            beam=self._beam_search(body, params, prompts),
        )

    def _beam_search(self, body: Mapping[str, Any], params: SamplingParams,
                     prompts: list[list[int]]) -> BeamSearchParams | None:
        """vLLM's ``use_beam_search``: ``n`` beams, ranked with ``length_penalty``. It takes the
        model's own distribution, so sampling, stops, logprobs and constraints do not apply."""
        length_penalty = _optional(body, "length_penalty", float)
        if not _optional(body, "use_beam_search", bool):
            if length_penalty is not None:
                raise invalid("length_penalty needs use_beam_search", "length_penalty")
            return None
        for field in ("stop", "logprobs", "top_logprobs", "echo", "logit_bias", "response_format", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "return_hidden_states"):
            if body.get(field) not in (None, False, [], {}):
                raise invalid(f"{field} cannot be combined with use_beam_search", field)
        max_tokens = params.max_tokens or self.max_model_len - max(map(len, prompts))
        try:
            return BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                                    length_penalty=1.0 if length_penalty is None else length_penalty)
        except ValueError as err:
            raise invalid(f"use_beam_search: {err} (the beam width is n)", "n") from None

    def _check_context(self, prompts: list[list[int]], max_tokens: int | None, where: str) -> None:
        for ids in prompts:
            wanted = len(ids) + (max_tokens or 1)
            if wanted > self.max_model_len:
                asked = f"{max_tokens} in the completion" if max_tokens else "at least 1 in the completion"
                raise invalid(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{wanted} tokens ({len(ids)} in the {where}, {asked}). Please reduce the length of the "
                    f"{where} or max_tokens.",
                    where, code="context_length_exceeded",
                )

    def _sampling_params(
        self, body: Mapping[str, Any], n: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise invalid("stop must be a non-empty string or a list of non-empty strings", "stop")
            if len(stop) > MAX_STOP_SEQUENCES:
                raise invalid(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}", "stop")
        fields = {
            "temperature": _optional(body, "temperature", float),
            "top_p": _optional(body, "top_p", float),
            "top_k": _optional(body, "top_k", int),
            "min_p": _optional(body, "min_p", float),
            "presence_penalty": _optional(body, "presence_penalty", float),
            "frequency_penalty": _optional(body, "frequency_penalty", float),
            "repetition_penalty": _optional(body, "repetition_penalty", float),
            "min_tokens": _optional(body, "min_tokens", int),
            "seed": _optional(body, "seed", int),
            "ignore_eos": _optional(body, "ignore_eos", bool),
            "stop_token_ids": _optional(body, "stop_token_ids", list),
            "skip_special_tokens": _optional(body, "skip_special_tokens", bool),
            "include_stop_str_in_output": _optional(body, "include_stop_str_in_output", bool),
            "return_hidden_states": _optional(body, "return_hidden_states", list),
            "hidden_states_include_prompt": _optional(body, "hidden_states_include_prompt", bool),
        }
        if fields["temperature"] is not None and fields["temperature"] > 2:
            raise invalid(f"temperature must be in [0, 2], got {fields['temperature']}", "temperature")
        vocab = self.tokenizer.vocab_size
        if fields["stop_token_ids"] is not None and not all(_is_int(t) and 0 <= t < vocab
                                                             for t in fields["stop_token_ids"]):
            raise invalid(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        if fields["min_tokens"] is not None and fields["min_tokens"] > self.max_model_len:
            raise invalid(f"min_tokens must be at most the context length {self.max_model_len}, "
                          f"got {fields['min_tokens']}", "min_tokens")
        given = {k: v for k, v in fields.items() if v is not None}
        logit_bias = self._logit_bias(body)
        if logit_bias:
            given["logit_bias"] = logit_bias
        structured = structured_output(body)
        if structured is not None:
            given["structured_output"] = structured
        try:
            return SamplingParams(n=n, max_tokens=max_tokens, stop=stop, logprobs=logprobs, **given)
        except SamplingParamsError as err:
            field = next((k for k in (*given, "n", "max_tokens", "logprobs") if str(err).startswith(k)), None)
            raise invalid(str(err), field) from None

    def _logit_bias(self, body: Mapping[str, Any]) -> dict[int, float] | None:
        """OpenAI's ``{"token id": bias}``, ids in the vocabulary, biases in [-100, 100]."""
        raw = _optional(body, "logit_bias", dict)
        if not raw:
            return None
        if len(raw) > MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(raw)}", "logit_bias")
        vocab = self.tokenizer.vocab_size
        out = {}
        for key, bias in raw.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
            if token is None or token >= vocab:
                raise invalid(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}"[:300], "logit_bias")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100):
                raise invalid(f"logit_bias values must be numbers in [-100, 100], got {bias!r}"[:300], "logit_bias")
            out[token] = float(bias)
        return out


_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _refuse_unknown(body: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])


def _optional(body: Mapping[str, Any], field: str, kind: type, param: str | None = None) -> Any:
    """``body[field]`` checked to be of ``kind`` (ints pass as floats; bools are not ints), or None.
    ``param`` names the field in the error when it is nested."""
    param = param or field
    value = body.get(field)
    if value is None:
        return None
    ok = {
        bool: isinstance(value, bool),
        int: _is_int(value),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list),
        dict: isinstance(value, dict),
    }[kind]
    if not ok:
        names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
        raise invalid(f"{param} must be {names[kind]}, got {type(value).__name__} {value!r}"[:300], param)
    return float(value) if kind is float else value
