"""Strict checks of response bodies and stream events against the official SDKs' own pydantic types
(openai.types.responses, anthropic.types): validated as the SDK's type, with no field the SDK does not
know at any depth (the SDKs' models keep unknown fields as extras; here an extra fails) and no field
missing: required ones by pydantic's own check, optional ones unless OMITTED names them (fields of
features this server does not have, which the APIs leave out or null too)."""

from __future__ import annotations

import json
import typing

import anthropic.types as A
import httpx
import openai.types.responses as R
import pydantic

OMITTED = {  # SDK type -> its optional fields this server leaves out
    "Response": {
        *("access_programs", "background", "completed_at", "conversation", "image", "input_transformations"),
        *("max_tool_calls", "moderation", "prompt", "prompt_cache_diagnostics", "prompt_cache_key"),
        *("prompt_cache_options", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier"),
        *("tool_usage", "top_logprobs", "user"),
    },
    "ResponseOutputMessage": {"phase"},  # agentic phases: none here
    "ResponseTextConfig": {"verbosity"},  # not a setting here (refused in a request)
    "InputTokensDetails": {"cache_write_tokens_details"},
    "ResponseFunctionToolCall": {"async_", "caller", "namespace"},  # no async / nested tool callers
    "FunctionTool": {"allowed_callers", "async_", "defer_loading", "output_schema"},
    "ResponseFormatTextJSONSchemaConfig": {"description", "strict"},  # echoed as the request gave them
    "Message": {"container", "diagnostics", "stop_details"},  # no code-execution containers
    "Usage": {
        *("cache_creation", "cache_creation_input_tokens", "cache_read_input_tokens", "inference_geo"),
        *("output_tokens_details", "server_tool_use", "service_tier", "speed"),
    },
    "MessageDeltaUsage": {
        *("cache_creation_input_tokens", "cache_read_input_tokens", "input_tokens", "output_tokens_details"),
        "server_tool_use",
    },
    "Delta": {"container", "stop_details"},
    "TextBlock": {"citations"},
    "ToolUseBlock": {"caller", "toolset_name"},
}


def _no_extra(value, path: str) -> None:
    if isinstance(value, pydantic.BaseModel):
        extra = value.__pydantic_extra__ or {}
        assert not extra, f"{path}: fields the SDK does not know: {sorted(extra)}"
        missing = set(type(value).model_fields) - value.model_fields_set - OMITTED.get(type(value).__name__, set())
        assert not missing, f"{path} ({type(value).__name__}): fields missing: {sorted(missing)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_extra(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_extra(v, f"{path}.{k}")


def strict(model, data: dict):
    """`data` as the SDK type `model`, refusing extra and missing fields."""
    obj = pydantic.TypeAdapter(model).validate_python(data)
    _no_extra(obj, model.__name__ if hasattr(model, "__name__") else "$")
    return obj


def _by_type(union) -> dict[str, type]:
    """The members of an SDK event union (Annotated[Union[...], discriminator]) by their `type`."""
    members = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


RESPONSE_EVENTS = _by_type(R.ResponseStreamEvent)
MESSAGE_EVENTS = _by_type(A.RawMessageStreamEvent)


def strict_response_event(event: dict):
    assert event.get("type") in RESPONSE_EVENTS, f"not a Responses stream event: {event}"
    return strict(RESPONSE_EVENTS[event["type"]], event)


def strict_message_event(event: dict):
    if event.get("type") == "ping":
        assert event == {"type": "ping"}
        return event
    if event.get("type") == "error":
        return strict(A.ErrorResponse, event)
    assert event.get("type") in MESSAGE_EVENTS, f"not a Messages stream event: {event}"
    return strict(MESSAGE_EVENTS[event["type"]], event)


def typed_events(response: httpx.Response) -> list[dict]:
    """The typed SSE events of a stream (`event: <type>` then `data: {...}`); each event's name must be
    its body's type."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            assert name == event["type"], f"event: {name} carries a {event['type']}"
            events.append(event)
            name = None
    return events
