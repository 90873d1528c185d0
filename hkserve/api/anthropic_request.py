"""Anthropic's Messages API request (POST /v1/messages) and its translation to the chat route's terms:
system and messages (text, tool_use and tool_result blocks) as chat messages, tools and tool_choice
as OpenAI-style tools, stop_sequences as stop strings.

Unknown fields are refused (400), not ignored: each field accepted here does what it says."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hkserve.api.protocol import MAX_STOP, OPENAI_SAMPLING, APIError
from hkserve.model.sampling import SamplingParams


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)  # {role, content}: read by _turn
    max_tokens: int  # required, as Anthropic's; checked by prepare.token_limits
    system: str | list[dict[str, Any]] | None = None  # text blocks
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, v):
        if v and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def sampling(self, seed: int) -> SamplingParams:
        """Temperature 1 unless given (Anthropic's default), top_p, top_k. Raises InvalidSampling."""
        given = self.model_dump(include={"temperature", "top_p", "top_k"})
        return replace(OPENAI_SAMPLING, seed=seed).with_overrides(given)

    def chat_tools(self) -> list[dict] | None:
        """Anthropic tools ({name, description, input_schema}) in the chat shape."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            unknown = set(tool) - {"name", "description", "input_schema", "type"}
            if unknown or tool.get("type", "custom") != "custom":
                raise APIError(400, f"tools.{i}: only custom tools {{name, description, input_schema}}", param="tools")
            fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> tuple[Any, bool | None]:
        """(the chat route's tool_choice, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
        if unknown or kind not in ("auto", "any", "tool", "none"):
            raise APIError(400, "tool_choice must be {type: auto | any | tool | none}", param="tool_choice")
        parallel = not choice.get("disable_parallel_tool_use", False)
        if kind == "tool":
            return {"type": "function", "function": {"name": choice.get("name")}}, parallel
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel

    def chat_messages(self) -> list[dict]:
        """system and messages as chat messages: tool_result blocks become tool messages, an
        assistant's tool_use blocks its tool_calls."""
        out: list[dict] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _texts(self.system)
            if system is None:
                raise APIError(400, "system is a string or a list of text blocks {type: text, text}", param="system")
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _turn(m, i)
        return out


def _turn(message: dict, i: int) -> list[dict]:
    """One turn, {role: user | assistant, content: a string or blocks}, as chat messages."""
    role, content = message.get("role"), message.get("content")
    if set(message) != {"role", "content"} or role not in ("user", "assistant"):
        raise _bad(i, "a message is {role: user | assistant, content}")
    if isinstance(content, str):
        return _blocks(role, [{"type": "text", "text": content}], i)
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(i, "content is a string or a list of blocks")
    return _blocks(role, content, i)


def _blocks(role: str, blocks: list[dict], i: int) -> list[dict]:
    text, calls, results = [], [], []
    for block in blocks:
        block = {k: v for k, v in block.items() if v is not None}  # a null field asks for nothing
        kind = block.get("type")
        if kind == "text" and set(block) <= {"type", "text"} and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, i))
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "content": _result(block, i), "tool_call_id": block["tool_use_id"]})
        else:
            raise _bad(i, f"content blocks of type {kind!r} are not supported here")
    out = results  # tool results answer the previous turn's calls, so they come first
    if text or calls or not results:
        message: dict = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _texts(blocks) -> str | None:
    """The text of a list of text blocks ({type: text, text}; cache_control, citations and any other
    field refused), or None when it is not one."""
    if not isinstance(blocks, list):
        return None
    ok = all(isinstance(b, dict) and set(b) == {"type", "text"} and b["type"] == "text" for b in blocks)
    return "".join(b["text"] for b in blocks) if ok and all(isinstance(b["text"], str) for b in blocks) else None


def _bad(i: int, message: str) -> APIError:
    return APIError(400, f"messages.{i}: {message}", param="messages")


def _call(block: dict, i: int) -> dict:
    if set(block) != {"type", "id", "name", "input"} or not isinstance(block["input"], dict):
        raise _bad(i, "a tool_use block is {type, id, name, input (an object)}")
    if not isinstance(block["id"], str) or not isinstance(block["name"], str):
        raise _bad(i, "a tool_use block's id and name are strings")
    arguments = json.dumps(block["input"])
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _result(block: dict, i: int) -> str:
    if set(block) - {"type", "tool_use_id", "content", "is_error"} or not isinstance(block.get("tool_use_id"), str):
        raise _bad(i, "a tool_result block is {type, tool_use_id, content}")
    content = block.get("content", "")
    if not isinstance(content, str):
        content = _texts(content)
        if content is None:
            raise _bad(i, "a tool_result's content is a string or text blocks")
    return f"Error: {content}" if block.get("is_error") is True else content  # the model sees the tool failed
