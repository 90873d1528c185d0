"""Who may call what, checked by the guard (guard.py) before any route runs: the API key on every
path but the open ones (as OpenAI's clients send it, `Authorization: Bearer`, or as Anthropic's,
`x-api-key`), and readiness on the generation routes (/v1/models answers while loading)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from hkserve.api import web
from hkserve.api.context import check_ready
from hkserve.api.protocol import APIError

OPEN_PATHS = {"/health", "/metrics", *web.PAGE_PATHS}  # the chat page loads without the key; its API calls send it


def key_matches(authorization: str, api_key: str) -> bool:
    """'Bearer KEY' (the scheme is case-insensitive, RFC 7235), compared in constant time."""
    scheme, _, given = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def key_given(headers: dict[str, str], api_key: str) -> bool:
    """The key in either header (`headers`: lower-cased names)."""
    anthropic = headers.get("x-api-key")
    if anthropic is not None and hmac.compare_digest(anthropic.strip().encode(), api_key.encode()):
        return True
    return key_matches(headers.get("authorization", ""), api_key)


def access_check(state, api_key: str | None) -> Callable[[dict], None]:
    """The guard's check of an ASGI scope against the key and the app's `state` (APIError 401 / 503)."""

    def check(scope: dict) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if api_key and path not in OPEN_PATHS and scope.get("method") != "OPTIONS" and not key_given(headers, api_key):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                "authentication_error",
                code="invalid_api_key",
            )
        if path.startswith("/v1/") and path != "/v1/models":
            check_ready(state)

    return check
