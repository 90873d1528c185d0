"""`hkserve serve` as a process: 503 while warming up, then serving; SIGTERM drains in-flight streams."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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


def test_health_turns_ready_and_sigterm_lets_running_streams_finish(tiny_home):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HKSERVE_HOME": str(tiny_home), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", "tiny", "--port", str(port), "--slots", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        statuses = []
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                statuses.append(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                pass
            if statuses and statuses[-1] == 200:
                break
            time.sleep(0.1)
        assert statuses[-1] == 200, statuses
        body = {
            "model": "tiny",
            "prompt": "In the beginning",
            "max_tokens": 150,
            "stream": True,
            "temperature": 0,
            "stop": ["never-appears"],
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]"
        assert any('"finish_reason": "length"' in line for line in rest)  # ran to its end, not cut
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read()
    assert "Finished server process" in output or "Shutting down" in output, output[-2000:]
