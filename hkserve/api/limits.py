"""What one client may cost the server: body size and read time, how long a response may wait for a
client that does not read, how far a stream may fall behind, how many connections are open at once
and how long a request's head may take to arrive. `hkserve serve` exposes each as a flag.

The head deadline lives in the HTTP protocol (uvicorn's h11, which has none of its own); the rest is
the ASGI guard's (guard.py), the stream backlog is Generation's, the connection cap uvicorn's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20  # bytes received, whether sent with Content-Length or chunked
    body_timeout_s: float = 30.0  # to receive a whole request body
    header_timeout_s: float = 10.0  # from connecting (or the last response) to a request's complete head
    send_timeout_s: float = 30.0  # one write of a response may wait this long for a client that does not read
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # open connections (and requests) at once; beyond, uvicorn answers 503
    max_stream_backlog: int = 1024  # events a stream may hold for a client that reads too slowly: then cancelled
    cpu_threads: int = 4  # threads parsing bodies, rendering chat templates and tokenizing, off the event loop


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `head_timeout` seconds of connecting or of the previous response (slowloris clients)."""

    head_timeout = ServerLimits.header_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_overdue)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_overdue)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def _head_overdue(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no complete head yet
            self.transport.close()


def uvicorn_config(app, limits: ServerLimits, **kwargs) -> uvicorn.Config:
    """A uvicorn config that applies the connection-level limits."""
    protocol = type("HeadTimeoutProtocol", (HeadTimeoutH11Protocol,), {"head_timeout": limits.header_timeout_s})
    return uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=limits.max_connections,
        **kwargs,
    )
