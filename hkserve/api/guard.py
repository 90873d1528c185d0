"""The ASGI guard around every route: a request-wide check (API key, readiness), the body read whole
before any route runs (at most `max_body_bytes` as received, chunked or not, within `body_timeout_s`),
response writes bounded in time, and an unexpected exception as a 500 that names a request id and
keeps the connection usable (the details go to the log only).

Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from the routes).
"""

from __future__ import annotations

import logging
import uuid

import anyio
from fastapi.responses import JSONResponse

from hkserve.api.anthropic_errors import error_body
from hkserve.api.limits import ServerLimits
from hkserve.api.protocol import APIError

log = logging.getLogger("hkserve.api")


class ClientTooSlow(Exception):
    """A response write waited longer than the send timeout: the client stopped reading."""


class GuardMiddleware:
    def __init__(self, app, check, limits: ServerLimits):
        self.app, self.check, self.limits = app, check, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_in_time(message):
            nonlocal started
            started = True
            try:
                with anyio.fail_after(self.limits.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlow from None

        try:
            self.check(scope)
            body = await self._read_body(scope, receive)
        except APIError as e:
            return await _respond(e, scope, receive, send_in_time)
        if body is None:  # the client left while sending
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: only a disconnect can come
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send_in_time)
        except ClientTooSlow:
            log.warning("%s %s: the client stopped reading; closing the connection", scope["method"], scope["path"])
        except Exception:
            request_id = uuid.uuid4().hex
            log.exception("request %s (%s %s) failed", request_id, scope["method"], scope["path"])
            if started:
                raise  # mid-response: uvicorn closes the connection, the client sees a cut response
            message = f"internal server error (request id {request_id}); the details are in the server log"
            await _respond(APIError(500, message, "server_error"), scope, receive, send_in_time)

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body (None if the client disconnected), or APIError 413 / 408."""
        limit = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            raise _body_error(413, f"request body larger than {limit} bytes")
        chunks, received = [], 0
        try:
            with anyio.fail_after(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise _body_error(413, f"request body larger than {limit} bytes")
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _body_error(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s") from None


def _body_error(status: int, message: str) -> APIError:
    """An error sent before the body was read whole: the connection cannot carry another request."""
    return APIError(status, message, headers={"Connection": "close"})


async def _respond(error: APIError, scope, receive, send) -> None:
    body = error_body(scope["path"], error)
    await JSONResponse(body, status_code=error.status, headers=error.headers)(scope, receive, send)
