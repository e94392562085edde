"""The request fields that ask for structured output, read into one ``StructuredOutput``.

OpenAI's ``response_format`` (``text``, ``json_object``, or ``json_schema`` with ``{name,
schema, strict}``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and vLLM's newer ``structured_outputs`` object (one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``). At most one of them may constrain a request. The
shapes are checked here (400 naming the field); whether a schema or grammar compiles is the
worker's to say (400 with the compiler's message).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from raylm.router.errors import invalid
from raylm.workers.core.grammar import StructuredOutput

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's output constraint, or None when its output is free."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for field, key in _GUIDED_FIELDS.items():
        if body.get(field) is not None:
            found.append((field, _constraint(key, body[field], field)))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise invalid(f"give one way to constrain the output, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                      "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutput("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise invalid("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                      "response_format.json_schema")
    return StructuredOutput.json_schema(spec["schema"])


def _structured_outputs(value: Any) -> StructuredOutput:
    given = [key for key in _STRUCTURED_OUTPUTS_KEYS if isinstance(value, dict) and value.get(key) not in (None, False)]
    if not isinstance(value, dict) or len(given) != 1:
        raise invalid(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
                      "structured_outputs")
    key = given[0]
    if key == "json_object":
        return StructuredOutput("json_object")
    return _constraint(key, value[key], f"structured_outputs.{key}")


def _constraint(key: str, value: Any, param: str) -> StructuredOutput:
    """A ``json`` schema (object or JSON text), ``regex``, ``choice`` list or ``grammar`` text."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise invalid(f"{param} is not valid JSON: {err}", param) from None
        if not isinstance(value, dict):
            raise invalid(f"{param} must be a JSON schema object", param)
        return StructuredOutput.json_schema(value)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredOutput.choice(value)
    if not isinstance(value, str) or not value:
        raise invalid(f"{param} must be a non-empty string", param)
    return StructuredOutput("regex" if key == "regex" else "grammar", value)
