"""The multi-host control channel against hostile peers: on loopback, no model, no JAX.

Host 0 must keep accepting its real followers whatever else connects to the control port first, and
neither side may obey a peer that does not hold the shared secret."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from hkserve.multihost.control import Follower, Leader, PeerLost, load_secret, recv_frame, send_frame

SECRET = b"correct horse battery staple!!"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leader_in_thread(port: int, num_hosts: int, secret: bytes = SECRET, timeout: float = 30.0) -> dict:
    """Start a Leader in a thread; the dict gets "leader" or "error" when it finished accepting."""
    out: dict = {}

    def run():
        try:
            out["leader"] = Leader(port, num_hosts, lambda h, r: None, secret, accept_timeout=timeout)
        except Exception as e:  # reported to the test through `out`
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _raw(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _closed(sock: socket.socket, within: float = 10.0) -> bool:
    """Whether the other end closed within `within` seconds (draining whatever it sent before)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


@pytest.mark.parametrize(
    "attack",
    ["garbage", "json-list", "oversized", "forged-hello", "wrong-secret", "bad-host-id", "bool-host-id"],
)
def test_bad_peers_are_refused_and_real_followers_still_join(attack):
    port = free_port()
    state = _leader_in_thread(port, 2)
    sock = None
    while sock is None:  # the leader binds in its thread: retry until it listens
        try:
            sock = _connect(port)
        except ConnectionRefusedError:
            state["thread"].join(0.05)
    challenge = recv_frame(sock)
    assert challenge["op"] == "challenge"
    if attack == "garbage":
        _raw(sock, b"\xff\xfe not json")
    elif attack == "json-list":
        _raw(sock, json.dumps([1, 2, 3]).encode())
    elif attack == "oversized":
        sock.sendall(struct.pack(">I", 1 << 30))
    elif attack == "forged-hello":  # the pre-authentication protocol: no MAC at all
        send_frame(sock, {"op": "hello", "host_id": 1})
    elif attack == "wrong-secret":
        send_frame(sock, {"op": "hello", "host_id": 1, "nonce": "00", "mac": "0" * 64})
    elif attack == "bad-host-id":
        send_frame(sock, {"op": "hello", "host_id": 7, "nonce": "00", "mac": "0" * 64})
    elif attack == "bool-host-id":
        send_frame(sock, {"op": "hello", "host_id": True, "nonce": "00", "mac": "0" * 64})
    assert _closed(sock)  # refused: host 0 closed the connection and did not crash
    assert "error" not in state and state["thread"].is_alive()

    follower = Follower("127.0.0.1", port, 1, on_lost=lambda r: None, secret=SECRET, connect_timeout=10)
    state["thread"].join(30)
    assert "error" not in state, state.get("error")
    leader = state["leader"]
    leader.broadcast({"op": "step", "active": [True]})
    assert next(iter(follower)) == {"op": "step", "active": [True]}
    leader.close()


def test_a_follower_with_another_secret_is_refused_and_refuses():
    port = free_port()
    state = _leader_in_thread(port, 2, timeout=20)
    with pytest.raises(PeerLost, match="handshake"):
        Follower("127.0.0.1", port, 1, on_lost=lambda r: None, secret=b"x" * 32, connect_timeout=10)
    Follower("127.0.0.1", port, 1, on_lost=lambda r: None, secret=SECRET, connect_timeout=10)
    state["thread"].join(30)
    state["leader"].close()


def test_a_follower_does_not_obey_a_forged_host_0():
    """A server that pretends to be host 0 without the secret cannot pass the follower's check."""
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))

    def fake_leader():
        conn, _ = server.accept()
        send_frame(conn, {"op": "challenge", "nonce": "abcd"})
        recv_frame(conn)
        send_frame(conn, {"op": "welcome", "mac": "0" * 64})
        conn.recv(1)

    threading.Thread(target=fake_leader, daemon=True).start()
    with pytest.raises(PeerLost, match="host 0 failed authentication"):
        Follower("127.0.0.1", port, 1, on_lost=lambda r: None, secret=SECRET, connect_timeout=10)
    server.close()


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path):
    with pytest.raises(ValueError, match="shared secret"):
        load_secret({})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret({"HKSERVE_CONTROL_SECRET": "short"})
    assert load_secret({"HKSERVE_CONTROL_SECRET": "a" * 16}) == b"a" * 16
    path = tmp_path / "secret"
    path.write_text("b" * 40 + "\n")
    assert load_secret({"HKSERVE_CONTROL_SECRET_FILE": str(path)}) == b"b" * 40
