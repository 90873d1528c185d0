"""The control channel of a multi-host server: host 0 tells every other host which engine call comes
next, and each side watches the other's heartbeat.

Why a socket and not a collective: every engine call must be issued in the same order on every host,
and a host that dies must be noticed even while the others sit inside a device collective waiting for
it. A TCP connection per follower gives both: ordered messages, and an end-of-stream (or a missed
heartbeat) read by a thread that is never blocked on the device.

Frames are a 4-byte big-endian length and a JSON object (never pickle: the port is reachable by
whoever reaches the host). Heartbeats are frames {"op": "hb"} sent every `HEARTBEAT_S`.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hkserve.control")

HEARTBEAT_S = 1.0
TIMEOUT_S = 15.0  # silence after which the peer counts as lost
_LEN = struct.Struct(">I")
MAX_FRAME = 64 << 20


class PeerLost(ConnectionError):
    """The other end of a control connection closed, failed or went silent."""


def send_frame(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise PeerLost("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_FRAME:
        raise PeerLost(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return json.loads(_recv_exact(sock, size))


def _reader(sock: socket.socket, on_message: Callable[[dict], None], on_lost: Callable[[str], None]) -> None:
    """Read frames until the peer is gone; heartbeats only prove liveness."""
    sock.settimeout(TIMEOUT_S)
    try:
        while True:
            message = recv_frame(sock)
            if message.get("op") != "hb":
                on_message(message)
    except TimeoutError:
        on_lost(f"no heartbeat for {TIMEOUT_S:.0f} s")
    except (OSError, ValueError) as e:  # PeerLost, reset, bad JSON
        on_lost(str(e) or type(e).__name__)


class _Heartbeat:
    """Sends {"op": "hb"} on a socket every HEARTBEAT_S, sharing the socket's send lock."""

    def __init__(self, sock: socket.socket, lock: threading.Lock):
        self.sock, self.lock, self.stopped = sock, lock, threading.Event()
        threading.Thread(target=self._run, name="hkserve-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                with self.lock:
                    send_frame(self.sock, {"op": "hb"})
            except OSError:
                return  # the reader reports the loss


class Leader:
    """Host 0's end: accepts one connection from each other host, then broadcasts calls to all.

    `on_lost(host_id, reason)` is called once, from a watcher thread, for the first host lost.
    """

    def __init__(
        self,
        port: int,
        num_hosts: int,
        on_lost: Callable[[int, str], None],
        bind: str = "0.0.0.0",
        accept_timeout: float = 300.0,
    ):
        self.num_hosts, self.on_lost = num_hosts, on_lost
        self._lock = threading.Lock()
        self._lost = threading.Event()
        self._socks: dict[int, socket.socket] = {}
        server = socket.create_server((bind, port), reuse_port=False)
        server.settimeout(accept_timeout)
        try:
            while len(self._socks) < num_hosts - 1:
                try:
                    conn, addr = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, num_hosts)) - set(self._socks))
                    raise PeerLost(
                        f"hosts {missing} did not connect to the control port {port} within {accept_timeout:.0f} s"
                    ) from None
                conn.settimeout(TIMEOUT_S)
                hello = recv_frame(conn)
                host = hello.get("host_id")
                if (
                    hello.get("op") != "hello"
                    or not isinstance(host, int)
                    or not 0 < host < num_hosts
                    or host in self._socks
                ):
                    log.warning("rejected control connection from %s: %s", addr, hello)
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks[host] = conn
                log.info("host %d connected from %s:%d", host, *addr[:2])
        finally:
            server.close()
        self._beats = [_Heartbeat(s, self._lock) for s in self._socks.values()]
        for host, sock in self._socks.items():
            threading.Thread(
                target=_reader,
                args=(sock, lambda m: None, self._lost_cb(host)),
                name=f"hkserve-watch-{host}",
                daemon=True,
            ).start()

    def _lost_cb(self, host: int) -> Callable[[str], None]:
        def lost(reason: str) -> None:
            if not self._lost.is_set():
                self._lost.set()
                self.on_lost(host, reason)

        return lost

    def broadcast(self, message: dict) -> None:
        """Send one call to every follower, in order. Raises PeerLost if a host is gone."""
        if self._lost.is_set():
            raise PeerLost("a host of this server was lost")
        with self._lock:
            for host, sock in self._socks.items():
                try:
                    send_frame(sock, message)
                except OSError as e:
                    self._lost_cb(host)(str(e))
                    raise PeerLost(f"host {host}: {e}") from e

    def close(self) -> None:
        for beat in self._beats:
            beat.stopped.set()
        self._lost.set()  # a closed channel is not a lost host
        for sock in self._socks.values():
            sock.close()


class Follower:
    """Another host's end: connects to host 0 and yields the calls it broadcasts, in order.

    Losing host 0 calls `on_lost(reason)` from the reader thread (the main thread may be blocked in a
    device collective that will never complete)."""

    def __init__(
        self,
        leader: str,
        port: int,
        host_id: int,
        on_lost: Callable[[str], None],
        connect_timeout: float = 300.0,
        max_pending: int = 4096,
    ):
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock = socket.create_connection((leader, port), timeout=TIMEOUT_S)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise PeerLost(f"cannot reach host 0's control port {leader}:{port}: {e}") from e
                time.sleep(0.5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        with self._lock:
            send_frame(self.sock, {"op": "hello", "host_id": host_id})
        # Bounded: when full the reader stops reading and TCP pushes back on host 0.
        self.calls: queue.Queue = queue.Queue(maxsize=max_pending)
        self._beat = _Heartbeat(self.sock, self._lock)
        threading.Thread(
            target=_reader, args=(self.sock, self.calls.put, on_lost), name="hkserve-control", daemon=True
        ).start()

    def __iter__(self):
        while True:
            yield self.calls.get()
