"""A client that disconnects mid-generation frees its slot, over HTTP on the real runner and engine (a
tiny random model). The engine decodes only the steps the test allows, so the request is certainly
still generating when the client leaves, and the slot count is read on the runner's thread the moment
the request ends: no timing decides the outcome."""

from __future__ import annotations

import json
import queue
import socket
import threading

import httpx
import pytest
from helpers import init_params, tiny_config
from http_helpers import LiveServer

from hkserve.api.app import create_app
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.runner import InferenceRunner, RunnerStats
from hkserve.model.build import build_model

WAIT = 300  # seconds; only a broken server (or a prefill compile on a very loaded machine) takes this long


class SteppedEngine(Engine):
    """Runs a decode step only when the test has allowed one (`allow`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting = threading.Event()  # a step waits for permission
        self.hold()

    def hold(self) -> None:
        """From now on no step runs unless allowed (call while no runner drives the engine)."""
        self._permits = threading.Semaphore(0)
        self.waiting.clear()

    def allow(self, steps: int) -> None:
        self._permits.release(steps)

    def step(self, active):
        if not self._permits.acquire(blocking=False):
            self.waiting.set()
            if not self._permits.acquire(timeout=WAIT):
                raise TimeoutError("the test allowed no further step")
            self.waiting.clear()
        return super().step(active)


class WatchedRunner(InferenceRunner):
    """The real runner, reporting each cancel call, and each request's end with the slot count read
    right after it (on the loop thread, so nothing runs in between)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.ended: queue.SimpleQueue[tuple[str, str, RunnerStats]] = queue.SimpleQueue()

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self.cancels.put(request_id)

    def _finish(self, slot, stream, reason, error=None):
        super()._finish(slot, stream, reason, error)
        self._publish_stats()  # the snapshot as of this moment, on the loop thread
        self.ended.put((stream.request.id, reason, self.stats()))


@pytest.fixture(scope="module")
def engine(smollm2) -> SteppedEngine:
    config = tiny_config(vocab_size=smollm2[2].vocab_size)
    model = build_model(config)
    return SteppedEngine(model, init_params(config, 0), EngineOptions(slots=2, max_len=256, prefill_buckets=(16,)))


@pytest.fixture
def server(engine, smollm2):
    """A fresh runner and server on the shared engine (compiled once per module)."""
    engine.hold()
    runner = WatchedRunner(engine).start(warmup=False)
    live = LiveServer(create_app(runner, smollm2[2], "tiny", engine.max_len))
    yield live, runner, engine
    engine.allow(10_000)
    live.stop()
    runner.stop()


BODY = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def _stream_until_first_token(url: str, engine: SteppedEngine) -> None:
    """Stream a completion, read its first token chunk, disconnect once the engine waits mid-generation
    (were the loop between steps instead, it could sweep the cancel before the test reads the count).
    The line iterator stays referenced: dropping it would close the connection early."""
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=WAIT) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        line = next(line for line in lines if line.startswith("data: "))
        assert json.loads(line[len("data: ") :])["choices"][0]["finish_reason"] is None
        assert engine.waiting.wait(WAIT), "the request never reached the held decode step"


def _post_then_hang_up(url: str, engine: SteppedEngine) -> None:
    """Send a whole-body completion, hang up once the engine is mid-generation."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert engine.waiting.wait(WAIT), "the request never reached a decode step"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_generation_frees_the_slot_at_once(server, stream):
    live, runner, engine = server
    engine.allow(3)  # the prefill's token and two steps' reach the client; the fourth step waits
    if stream:
        _stream_until_first_token(live.url, engine)
    else:
        _post_then_hang_up(live.url, engine)
    cancelled = runner.cancels.get(timeout=WAIT)  # the server saw the disconnect and cancelled
    assert runner.stats().running == 1  # still generating: the engine has not moved since
    engine.allow(10_000)
    request_id, reason, stats = runner.ended.get(timeout=WAIT)
    assert (request_id, reason) == (cancelled, "cancelled")
    assert (stats.running, stats.waiting) == (0, 0)  # freed when it ended, not eventually
    assert runner.ended.empty()
