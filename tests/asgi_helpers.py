"""Driving an ASGI middleware directly with a scripted list of messages (no server, no event-loop timing):
what it sent back and what the app behind it received."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import anyio

from hkserve.api.guard import GuardMiddleware
from hkserve.api.limits import ServerLimits


@dataclass
class Recorder:
    """The app behind the guard: reads `reads` messages, then answers 200 "ok" (or raises `fail`, before
    or after starting its response)."""

    reads: int = 1
    fail: Exception | None = None
    fail_after_start: bool = False
    received: list[dict] = field(default_factory=list)
    scopes: list[dict] = field(default_factory=list)

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        for _ in range(self.reads):
            self.received.append(await receive())
        if self.fail is not None and not self.fail_after_start:
            raise self.fail
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.fail is not None:
            raise self.fail
        await send({"type": "http.response.body", "body": b"ok"})


def body_messages(chunks: list[bytes]) -> list[dict]:
    """One `http.request` message per chunk, the last without more_body."""
    return [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]


def drive(
    app,
    messages: list[dict],
    limits: ServerLimits,
    check=lambda scope: None,
    headers: list[tuple[bytes, bytes]] = (),
    scope_type: str = "http",
    send_blocks: bool = False,
    path: str = "/v1/completions",
) -> list[dict]:
    """One request through a GuardMiddleware → the messages it sent. After `messages`, receive waits
    forever (a client that sends nothing more); with `send_blocks`, so does every send (one that does
    not read)."""
    sent: list[dict] = []
    scope = {"type": scope_type, "method": "POST", "path": path, "headers": list(headers)}
    never = anyio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await never.wait()

    async def send(message):
        if send_blocks:
            await never.wait()
        sent.append(message)

    anyio.run(GuardMiddleware(app, check, limits), scope, receive, send)
    return sent


def response(sent: list[dict]) -> tuple[int, dict, bytes]:
    """(status, headers as a dict, body) of the sent messages."""
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def error(sent: list[dict]) -> dict:
    return json.loads(response(sent)[2])["error"]
