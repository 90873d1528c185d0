"""What a request's output must match: OpenAI's `response_format` and vLLM's `structured_outputs`, read
from plain JSON values (HTTP bodies and `hkserve sample` lines alike) into a GrammarSpec."""

from __future__ import annotations

import json
from typing import Any

from hkserve.engine.constrained import GrammarSpec

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class FieldError(ValueError):
    """A request field that cannot be honoured; `param` names it (HTTP 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise FieldError(param, f"{param}: the schema is not valid JSON ({e.msg})") from None
    if not isinstance(schema, dict):
        raise FieldError(param, f"{param}: the schema must be a JSON object")
    return json.dumps(schema)


def response_format_spec(fmt: Any) -> GrammarSpec | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise FieldError("response_format", "response_format must be an object with a type")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError("response_format", "response_format.json_schema must be an object {name, schema}")
        if "schema" not in spec:
            return GrammarSpec("json_object")
        return GrammarSpec("json_schema", _schema_text(spec["schema"], "response_format"))
    raise FieldError("response_format", f"response_format type must be text, json_object or json_schema, got {kind!r}")


def structured_outputs_spec(value: Any) -> GrammarSpec | None:
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice (strings), grammar
    (Lark), json_object (true)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("structured_outputs", "structured_outputs must be an object")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise FieldError("structured_outputs", f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}")
    key, item = given[0], value[given[0]]
    if key == "json":
        return GrammarSpec("json_schema", _schema_text(item, "structured_outputs"))
    if key == "json_object":
        return GrammarSpec("json_object")
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) and c for c in item):
            raise FieldError("structured_outputs", "structured_outputs.choice must be a list of non-empty strings")
        return GrammarSpec("choice", json.dumps(item))
    if not isinstance(item, str) or not item:
        raise FieldError("structured_outputs", f"structured_outputs.{key} must be a non-empty string")
    return GrammarSpec("regex" if key == "regex" else "lark", item)


def output_spec(response_format: Any, structured_outputs: Any) -> GrammarSpec | None:
    """The one grammar a request's fields ask for, or None; both at once is refused."""
    a, b = response_format_spec(response_format), structured_outputs_spec(structured_outputs)
    if a is not None and b is not None:
        raise FieldError("structured_outputs", "give either response_format or structured_outputs, not both")
    return a or b
