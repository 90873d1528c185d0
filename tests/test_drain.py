"""SIGTERM drains: the socket keeps answering (/health 503 "draining", new generations 503) until
the runner has nothing running or waiting, and only then does the server stop. Event-ordered: the
test decides when the runner becomes idle."""

from __future__ import annotations

import signal
import socket
import threading

import httpx
import uvicorn
from http_helpers import FakeRunner

from hkserve.api.app import create_app
from hkserve.cli.serve import DrainingServer, bind_socket
from hkserve.engine.runner import RunnerStats


class BusyRunner(FakeRunner):
    """Reports one running request until `idle` is set."""

    def __init__(self, script):
        super().__init__(script)
        self.idle = threading.Event()

    def stats(self) -> RunnerStats:
        return RunnerStats(4, 0 if self.idle.is_set() else 1, 0)


def test_draining_answers_503_until_idle_then_stops(smollm2):
    tokenizer = smollm2[2]
    runner = BusyRunner(tokenizer.encode("Hello there") + [tokenizer.eos_id])
    app = create_app(runner, tokenizer, "m", 256)
    listener = bind_socket("127.0.0.1", 0)
    address = listener.getsockname()
    url = f"http://127.0.0.1:{address[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="off"), app, runner)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        while not server.started:  # bounded by the test's timeout, not by a guess at startup time
            assert thread.is_alive(), "the server thread ended before it started"
            thread.join(0.05)
        assert httpx.get(url + "/health").status_code == 200

        server.handle_exit(signal.SIGTERM, None)
        for _ in range(3):  # still accepting connections while a request runs
            health = httpx.get(url + "/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["message"]
        assert thread.is_alive()

        runner.idle.set()  # the last running request finished
        thread.join(120)  # bounds a hang only
        assert not thread.is_alive()
    finally:
        server.should_exit = True
        thread.join(10)
    with socket.socket() as s:
        assert s.connect_ex(address) != 0  # the port is closed
