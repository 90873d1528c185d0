"""Errors on the Anthropic Messages route leave in Anthropic's error body,
{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}, with the same status; every other path
keeps OpenAI's (protocol.APIError.body)."""

from __future__ import annotations

import uuid

from hkserve.api.protocol import APIError

ANTHROPIC_PATHS = frozenset({"/v1/messages"})
TYPES = {  # status -> Anthropic's error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_body(error: APIError) -> dict:
    default = "invalid_request_error" if error.status < 500 else "api_error"
    error_object = {"type": TYPES.get(error.status, default), "message": error.message}
    return {"type": "error", "error": error_object, "request_id": "req_" + uuid.uuid4().hex}


def error_body(path: str, error: APIError) -> dict:
    """The error's body for a request to `path`."""
    return anthropic_body(error) if path in ANTHROPIC_PATHS else error.body()
