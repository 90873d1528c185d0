"""The control channel of a multi-host server: host 0 tells every other host which engine call comes
next, and each side watches the other's heartbeat.

Why a socket and not a collective: every engine call must be issued in the same order on every host,
and a host that dies must be noticed even while the others sit inside a device collective waiting for
it. A TCP connection per follower gives both: ordered messages, and an end-of-stream (or a missed
heartbeat) read by a thread that is never blocked on the device.

Frames are a 4-byte big-endian length and a JSON object (never pickle: the port is reachable by
whoever reaches the host). Heartbeats are frames {"op": "hb"} sent every `HEARTBEAT_S`.

Whoever reaches the port could otherwise join as a host and receive every request's prompt ids, or
pose as host 0 and drive a follower's device. So both ends prove they hold the server's shared
secret before anything else is sent (an HMAC-SHA256 challenge each way, nonces fresh per
connection), host 0 listens on the coordinator's interface only, and a connection that sends
anything unexpected (garbage, a JSON list, an oversized frame, a wrong MAC, silence) is closed and
logged without disturbing the others.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
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
HANDSHAKE_FRAME = 4096  # frames before authentication are tiny: no large buffers for strangers
HANDSHAKE_S = 5.0
SECRET_ENV, SECRET_FILE_ENV = "HKSERVE_CONTROL_SECRET", "HKSERVE_CONTROL_SECRET_FILE"
MIN_SECRET = 16


class PeerLost(ConnectionError):
    """The other end of a control connection closed, failed or went silent."""


class BadPeer(ValueError):
    """A connection that is not a host of this server (bad frame or failed authentication)."""


def load_secret(environ=os.environ) -> bytes:
    """The shared secret of the hosts: $HKSERVE_CONTROL_SECRET, or the contents of the file named by
    $HKSERVE_CONTROL_SECRET_FILE (e.g. a Docker/Kubernetes secret). At least 16 bytes."""
    path = environ.get(SECRET_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
    else:
        secret = environ.get(SECRET_ENV, "").encode()
    if len(secret) < MIN_SECRET:
        raise ValueError(
            f"multi-host serving needs a shared secret of at least {MIN_SECRET} bytes in {SECRET_ENV} or a file "
            f"named by {SECRET_FILE_ENV}, the same on every host (e.g. `openssl rand -hex 32`)"
        )
    return secret


def _mac(secret: bytes, *parts: object) -> str:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


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


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    """One frame's JSON object. Oversized frames raise PeerLost; anything but an object, BadPeer."""
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > limit:
        raise PeerLost(f"frame of {size} bytes exceeds {limit}")
    try:
        message = json.loads(_recv_exact(sock, size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadPeer(f"not a JSON frame: {e}") from None
    if not isinstance(message, dict):
        raise BadPeer(f"expected a JSON object, got {type(message).__name__}")
    return message


def _expect(message: dict, op: str, **types: type) -> dict:
    if message.get("op") != op or any(not isinstance(message.get(k), t) for k, t in types.items()):
        raise BadPeer(f"expected {op!r} with {sorted(types)}, got {str(message)[:200]}")
    return message


def _authenticate_follower(conn: socket.socket, secret: bytes, num_hosts: int, taken) -> int:
    """Host 0's side of the handshake → the follower's host id. Raises BadPeer / OSError / PeerLost."""
    nonce = os.urandom(16).hex()
    send_frame(conn, {"op": "challenge", "nonce": nonce})
    hello = _expect(recv_frame(conn, HANDSHAKE_FRAME), "hello", host_id=int, nonce=str, mac=str)
    host = hello["host_id"]
    if isinstance(host, bool) or not 0 < host < num_hosts or host in taken:
        raise BadPeer(f"host id {host!r} is not an expected host (1..{num_hosts - 1}, not yet connected)")
    if not hmac.compare_digest(hello["mac"], _mac(secret, "follower", nonce, host)):
        raise BadPeer(f"host {host} failed authentication (different {SECRET_ENV}?)")
    send_frame(conn, {"op": "welcome", "mac": _mac(secret, "leader", hello["nonce"], host)})
    return host


def _authenticate_leader(sock: socket.socket, secret: bytes, host_id: int) -> None:
    """A follower's side: prove the secret, and check host 0 holds it too before obeying it."""
    challenge = _expect(recv_frame(sock, HANDSHAKE_FRAME), "challenge", nonce=str)
    nonce = os.urandom(16).hex()
    mac = _mac(secret, "follower", challenge["nonce"], host_id)
    send_frame(sock, {"op": "hello", "host_id": host_id, "nonce": nonce, "mac": mac})
    welcome = _expect(recv_frame(sock, HANDSHAKE_FRAME), "welcome", mac=str)
    if not hmac.compare_digest(welcome["mac"], _mac(secret, "leader", nonce, host_id)):
        raise BadPeer(f"host 0 failed authentication (different {SECRET_ENV}?)")


def _reader(sock: socket.socket, on_message: Callable[[dict], None], on_lost: Callable[[str], None]) -> None:
    """Read frames until the peer is gone; heartbeats only prove liveness."""
    try:
        sock.settimeout(TIMEOUT_S)  # inside: a channel closed before this thread ran is a loss like any
        while True:
            message = recv_frame(sock)
            if message.get("op") != "hb":
                on_message(message)
    except TimeoutError:
        on_lost(f"no heartbeat for {TIMEOUT_S:.0f} s")
    except (OSError, ValueError) as e:  # PeerLost, reset, BadPeer
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
    """Host 0's end: accepts one authenticated connection from each other host, then broadcasts
    calls to all. Connections that fail the handshake are closed and do not count.

    `on_lost(host_id, reason)` is called once, from a watcher thread, for the first host lost.
    """

    def __init__(
        self,
        port: int,
        num_hosts: int,
        on_lost: Callable[[int, str], None],
        secret: bytes,
        bind: str = "127.0.0.1",
        accept_timeout: float = 300.0,
    ):
        self.num_hosts, self.on_lost = num_hosts, on_lost
        self._lock = threading.Lock()
        self._lost = threading.Event()
        self._socks: dict[int, socket.socket] = {}
        server = socket.create_server((bind, port), reuse_port=False)
        deadline = time.monotonic() + accept_timeout
        try:
            while len(self._socks) < num_hosts - 1:
                try:
                    server.settimeout(max(0.01, deadline - time.monotonic()))
                    conn, addr = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, num_hosts)) - set(self._socks))
                    raise PeerLost(
                        f"hosts {missing} did not connect to the control port {port} within {accept_timeout:.0f} s"
                    ) from None
                conn.settimeout(HANDSHAKE_S)
                try:
                    host = _authenticate_follower(conn, secret, num_hosts, self._socks)
                except (OSError, ValueError) as e:  # BadPeer, PeerLost, timeout, reset
                    log.warning("rejected control connection from %s:%d: %s", *addr[:2], e)
                    conn.close()
                    continue
                conn.settimeout(TIMEOUT_S)
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
        secret: bytes,
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
        try:
            _authenticate_leader(self.sock, secret, host_id)
        except (OSError, ValueError) as e:
            self.sock.close()
            raise PeerLost(f"control handshake with host 0 at {leader}:{port} failed: {e}") from None
        self._lock = threading.Lock()
        # Bounded: when full the reader stops reading and TCP pushes back on host 0.
        self.calls: queue.Queue = queue.Queue(maxsize=max_pending)
        self._beat = _Heartbeat(self.sock, self._lock)
        threading.Thread(
            target=_reader, args=(self.sock, self.calls.put, on_lost), name="hkserve-control", daemon=True
        ).start()

    def __iter__(self):
        while True:
            yield self.calls.get()
