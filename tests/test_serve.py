"""`hkserve serve` as a process: 503 while warming up, then serving; SIGTERM drains in-flight streams."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import REPO, hkserve, require_fixtures
from test_gguf import train_sentencepiece, write_llama_gguf


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    path = home / "tiny.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-tied", train_sentencepiece(200), quantize=False)
    hkserve("convert", str(path), "--name", "tiny", "--quiet", home=home)
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines:
    """A process's output lines, read in the background so the test can wait for one."""

    def __init__(self, stream):
        self.seen: list[str] = []
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in stream], daemon=True).start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until a line holding `text` is logged; the timeout only bounds a hang (pytest-timeout's 600 s
        would too), it is no deadline a loaded machine could miss."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.seen):
            try:
                self.seen.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"{text!r} not logged within {timeout} s:\n{''.join(self.seen)[-3000:]}") from None


def send(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_503_while_warming_up_and_sigterm_lets_a_running_stream_finish(tiny_home):
    """tests/serve_gated.py holds the warm-up, then a stream mid-way, until the test lets them go."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HKSERVE_HOME": str(tiny_home), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "serve_gated.py"),
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--slots",
            "2",
            "--max-len",
            "128",  # the shape of tests/test_sample.py's tiny runs: their compiled programs are reused
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Lines(proc.stdout)
    try:
        # The socket listens from before the model loads; once uvicorn's loop runs it answers what waits
        # in the backlog. The gate holds the warm-up.
        output.wait_for("Started server process")
        health = httpx.get(url + "/health", timeout=120)
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        body = {"model": "tiny", "prompt": "In the beginning", "max_tokens": 20, "temperature": 0, "logprobs": 1}
        refused = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["message"] == "the model is loading"
        send(proc, "warm")
        output.wait_for("ready: tiny")  # logged once the warm-up compile is done
        assert httpx.get(url + "/health", timeout=30).status_code == 200

        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            output.wait_for("draining: waiting for running requests")  # the signal landed mid-stream
            health = httpx.get(url + "/health", timeout=30)  # still answering while the stream runs
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 503
            send(proc, "decode")
            rest = [line for line in lines if line.startswith("data: ")]
            output.wait_for("Shutting down")  # only once the running stream has finished
        assert '"finish_reason": null' in first
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]  # ran to its end, not cut
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output.wait_for("Finished server process")


def test_a_port_in_use_fails_at_once_with_one_line(tiny_home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = hkserve("serve", "--model", "tiny", "--port", str(port), home=tiny_home, check=False, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == f"hkserve serve: error: port {port} on 127.0.0.1 is already in use"
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr
    assert "compiling prefill buckets" not in result.stderr  # it failed before the warm-up
