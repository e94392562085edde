"""Which tool-call format a served model uses (router/tool_formats.py,
router/tool_format_deepseek.py): named by the deploy file's ``model.tool_call_parser``, or read
from the chat template (``auto``); and what offering tools changes in a request's sampling."""

from __future__ import annotations

import dataclasses
import json

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.errors import invalid
from raylm.router.harmony import MARKERS as HARMONY_MARKERS
from raylm.router.reasoning import HARMONY_CHANNEL
from raylm.router.tool_format_deepseek import MARKERS, DeepSeekFormat
from raylm.router.tool_format_glm import Glm45Format
from raylm.router.tool_format_harmony import HarmonyFormat
from raylm.router.tool_format_pythonic import PYTHON_START, PythonicFormat
from raylm.router.tool_format_qwen3_coder import Qwen3CoderFormat
from raylm.router.tool_formats import (
    ARGS,
    PYTHON_TAG,
    TOOL_CALLS,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ToolFormat,
)
from raylm.router.tools import ToolUse
from raylm.workers.core.sampling_params import SamplingParams

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "glm45", "deepseek_v3", "qwen3_coder",
                     "pythonic", "harmony")

# What pythonic tool prompts show the model (Meta's Llama 4 prompt, vLLM's pythonic templates, Gemma 3's).
_PYTHONIC_INSTRUCTION = "[func_name1(param"


def detect_tool_call_parser(chat_template: str | None) -> str:
    """The format a chat template writes calls in (Hermes when it says nothing of its own)."""
    template = chat_template or ""
    if HARMONY_CHANNEL in template:
        return "harmony"
    if TOOL_CALLS in template:
        return "mistral"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<arg_key>" in template:
        return "glm45"
    if PYTHON_START in template or _PYTHONIC_INSTRUCTION in template:
        return "pythonic"
    if PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return "hermes"


def tool_format(name: str, tokenizer: Tokenizer) -> ToolFormat:
    """The format ``name`` (``auto``: the chat template's) for a model with ``tokenizer``."""
    if name == "auto":
        name = detect_tool_call_parser(tokenizer.chat_template)
    template = tokenizer.chat_template or ""
    fmt: ToolFormat
    if name == "hermes":
        fmt = HermesFormat({m: _marker(tokenizer, m) for m in HermesFormat.markers})
    elif name == "llama3_json":
        fmt = Llama3JsonFormat()
    elif name == "deepseek_v3":
        fmt = DeepSeekFormat("```json" in template, {m: _marker(tokenizer, m) for m in MARKERS})
    elif name == "qwen3_coder":
        fmt = Qwen3CoderFormat({m: _marker(tokenizer, m) for m in Qwen3CoderFormat.markers})
    elif name == "harmony":
        fmt = HarmonyFormat({m: _marker(tokenizer, m) for m in HARMONY_MARKERS})
    elif name == "pythonic":
        fmt = PythonicFormat()
    elif name == "glm45":
        fmt = Glm45Format({m: _marker(tokenizer, m) for m in Glm45Format.markers})
    elif name == "mistral":
        fmt = MistralFormat(ARGS in template, _marker(tokenizer, TOOL_CALLS), _marker(tokenizer, ARGS))
    else:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    # A marker that is a special token vanishes from text decoded without them: keep them.
    fmt.keep_special_tokens = any(_token_of(tokenizer, m) is not None and tokenizer.decode([_token_of(tokenizer, m)])
                                  == "" for m in fmt.markers)
    return fmt


def params_for_calls(fmt: ToolFormat, tool_use: ToolUse, params: SamplingParams) -> SamplingParams:
    """A chat request's sampling params when it offers tools: the grammar that forces calls
    (``required`` / a named function), and special tokens kept where the format's marker is one."""
    forced = fmt.grammar(tool_use)
    if forced is not None:
        if params.structured_output is not None:
            raise invalid("tool_choice required or a named function cannot be combined with structured output",
                          "tool_choice")
        params = dataclasses.replace(params, structured_output=forced)
    if fmt.keep_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def check_template_renders_tools(fmt: ToolFormat, tool_use: ToolUse | None, template_takes_tools: bool) -> None:
    """Only Hermes' format is described in the system message of a template without tools
    (router/tools.py); the others need the family's own template to show the tools."""
    if tool_use is not None and not template_takes_tools and fmt.name != "hermes":
        raise invalid(f"the {fmt.name} tool call format needs a chat template that renders tools", "tools")


def _token_of(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of ``text`` where the vocabulary has it as one added token (special or not)."""
    token_id = tokenizer.token_to_id(text)
    return token_id if token_id is not None and token_id in tokenizer.backend.get_added_tokens_decoder() else None


def _marker(tokenizer: Tokenizer, text: str) -> str:
    """A grammar literal for ``text``: the token itself where the vocabulary has it as one added
    token (llguidance's ``<[id]>``: it gives added tokens no text to match, and the model writes
    the marker as that one token), else the text."""
    token_id = _token_of(tokenizer, text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)
