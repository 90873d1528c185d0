"""OpenAI's Responses API request (POST /v1/responses) and its translation to the chat route's terms:
input items as chat messages, function tools as chat tools, `text.format` as a response format.

Unknown fields are refused (400), not ignored: each field accepted here does what it says."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hkserve.api.protocol import OPENAI_SAMPLING, APIError
from hkserve.model.sampling import SamplingParams

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = None  # checked by prepare.token_limits
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {format: {type: text | json_object | json_schema, ...}}
    previous_response_id: str | None = None
    store: bool = True  # kept for previous_response_id (response_store.py)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # echoed back
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: not implemented

    def sampling(self, seed: int) -> SamplingParams:
        """OpenAI's defaults with the request's temperature and top_p. Raises InvalidSampling."""
        return replace(OPENAI_SAMPLING, seed=seed).with_overrides(self.model_dump(include={"temperature", "top_p"}))

    def chat_tools(self) -> list[dict] | None:
        """Responses function tools ({type, name, description, parameters, strict}) in the chat shape."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                kind = tool.get("type")
                raise APIError(400, f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools")
            unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if unknown:
                raise APIError(400, f"tools[{i}]: unsupported fields {sorted(unknown)}", param="tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or set(choice) != {"type", "name"}:
                message = "tool_choice must be none, auto, required or {type: function, name}"
                raise APIError(400, message, param="tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def response_format(self) -> dict | None:
        """`text.format` as the chat route's response_format (structured.py reads it)."""
        if self.text is None:
            return None
        if set(self.text) - {"format"}:
            raise APIError(400, f"text: unsupported fields {sorted(set(self.text) - {'format'})}", param="text")
        fmt = self.text.get("format")
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return fmt
        if "schema" not in fmt or not isinstance(fmt.get("name"), str):
            raise APIError(400, "text.format json_schema needs a name and a schema", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"]}}

    def echoed_text(self) -> dict:
        """The `text` field as the response reports it."""
        return {"format": (self.text or {}).get("format") or {"type": "text"}}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Input items as chat messages (tools.render_messages' input): message items, function_call items
    (an assistant's calls) and function_call_output items (tool results)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function"}
            call["function"] = {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, i)
            out.append({"role": "tool", "content": text, "tool_call_id": _str(item, "call_id", i)})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
    if not out:
        raise APIError(400, "input must not be empty", param="input")
    return out


def _message(item: dict, i: int) -> dict:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise APIError(400, f"input[{i}]: role must be one of {sorted(ROLES)}", param="input")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_parts(content, i)
    return {"role": role, "content": text}


def _text_parts(parts: Any, i: int) -> str:
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise APIError(400, f"input[{i}]: content must be a string or a list of text parts", param="input")
    for p in parts:
        if p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
            raise APIError(400, f"input[{i}]: only input_text / output_text parts are supported", param="input")
    return "".join(p["text"] for p in parts)


def _str(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key} must be a string", param="input")
    return value


def output_messages(text: str, calls: list[tuple[str, str, str]]) -> list[dict]:
    """A reply as the chat messages a later turn continues from (previous_response_id):
    `calls` as (call_id, name, arguments)."""
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": c, "type": "function", "function": {"name": n, "arguments": a}} for c, n, a in calls
        ]
    return [message]
