"""The guard's body accounting, driven directly with ASGI messages: uvicorn merges the chunks of a real
connection before they reach the app, so only a direct drive proves that many small `http.request`
messages are counted together against `max_body_bytes` (issue 38)."""

from __future__ import annotations

import json

import anyio

from hkserve.api.guard import GuardMiddleware
from hkserve.api.limits import ServerLimits

LIMIT = 100


class Echo:
    """The app behind the guard: answers 200 with the body it received, in one `receive`."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def drive(chunks: list[bytes], headers: list[tuple[bytes, bytes]] = ()) -> tuple[Echo, list[dict]]:
    """One request whose body arrives as `chunks` (one `http.request` message each, the last without
    more_body) → the app and the messages the guard sent."""
    app, sent = Echo(), []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    guard = GuardMiddleware(app, lambda scope: None, ServerLimits(max_body_bytes=LIMIT))
    anyio.run(guard, scope, receive, send)
    return app, sent


def status_and_body(sent: list[dict]) -> tuple[int, bytes]:
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_many_small_chunks_adding_past_the_limit_are_refused_with_413():
    app, sent = drive([b"x" * 7] * 15)  # 105 bytes in 7-byte messages, each far under the limit
    status, body = status_and_body(sent)
    assert status == 413 and app.bodies == []
    error = json.loads(body)["error"]
    assert "larger than 100 bytes" in error["message"] and error["type"] == "invalid_request_error"
    assert (b"connection", b"close") in sent[0]["headers"]


def test_small_chunks_adding_up_to_exactly_the_limit_reach_the_app_whole():
    chunks = [bytes([65 + i]) * 10 for i in range(10)]  # 100 bytes: at the limit, not past it
    app, sent = drive(chunks)
    assert status_and_body(sent) == (200, b"ok")
    assert app.bodies == [b"".join(chunks)]


def test_one_byte_past_the_limit_in_the_last_of_many_chunks_is_refused():
    app, sent = drive([b"y" * 10] * 10 + [b"z"])
    assert status_and_body(sent)[0] == 413 and app.bodies == []


def test_a_declared_length_past_the_limit_is_refused_before_reading():
    app, sent = drive([b"x"], headers=[(b"content-length", b"101")])
    assert status_and_body(sent)[0] == 413 and app.bodies == []
