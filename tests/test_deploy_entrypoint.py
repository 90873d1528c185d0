"""The image's entrypoint and health check (deploy/entrypoint.py, deploy/healthcheck.py), run here as
the image runs them: every `hkserve serve` flag settable as HKSERVE_<FLAG>, a misspelt HKSERVE_*
variable refused, the health check's answer following /health."""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import re
import socket
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", ROOT / "deploy" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint, healthcheck = _load("entrypoint"), _load("healthcheck")


@pytest.fixture(scope="module")
def serve():
    return entrypoint.serve_parser()


def test_variables_become_flags_that_serve_parses(serve):
    environ = {
        "HKSERVE_PORT": "9000",
        "HKSERVE_SLOTS": "4",
        "HKSERVE_MAX_LEN": "512",
        "HKSERVE_CORS_ORIGIN": "https://a.example, https://b.example",
        "HKSERVE_BODY_TIMEOUT": "7.5",
        "HKSERVE_API_KEY": "not-on-the-command-line",
        "HKSERVE_HOME": "/models",
        "PATH": "/bin",
    }
    flags = entrypoint.flags_from_env(serve, environ)
    assert not any("not-on-the-command-line" in f for f in flags)
    args = serve.parse_args(flags)
    assert (args.port, args.slots, args.max_len, args.body_timeout_s) == (9000, 4, 512, 7.5)
    assert args.cors_origin == ["https://a.example", "https://b.example"]


def test_every_serve_flag_has_its_own_variable(serve):
    actions = [a for a in serve._actions if any(s.startswith("--") for s in a.option_strings) and a.dest != "help"]
    names = [entrypoint.env_name(a) for a in actions]
    assert len(set(names)) == len(names)
    for action, name in zip(actions, names):
        if name in entrypoint.READ_BY_HKSERVE:
            continue
        if action.nargs == 0:  # a switch (--no-web): on by a true value, the bare flag
            assert entrypoint.flags_from_env(serve, {name: "1"}) == [action.option_strings[-1]]
            continue
        value = str(action.choices[0]) if action.choices else "3"
        assert entrypoint.flags_from_env(serve, {name: value})[0].startswith(action.option_strings[-1] + "=")


def test_a_misspelt_variable_is_refused(serve):
    with pytest.raises(SystemExit, match="HKSERVE_SLOT\\b") as refused:
        entrypoint.flags_from_env(serve, {"HKSERVE_SLOT": "32"})
    assert "enableServiceLinks" not in str(refused.value)
    links = {"HKSERVE_SERVICE_HOST": "10.0.0.5", "HKSERVE_PORT_80_TCP_ADDR": "10.0.0.5"}  # a Service's, by Kubernetes
    with pytest.raises(SystemExit, match="enableServiceLinks: false"):
        entrypoint.flags_from_env(serve, links)


def test_every_variable_hkserve_reads_is_known_to_the_entrypoint(serve):
    """Refusing unknown HKSERVE_* variables must never refuse one hkserve reads: a new one goes into
    READ_BY_HKSERVE (or is a flag's)."""
    flags = {entrypoint.env_name(a) for a in serve._actions if any(s.startswith("--") for s in a.option_strings)}
    read = {m for f in (ROOT / "hkserve").rglob("*.py") for m in re.findall(r"\bHKSERVE_[A-Z0-9_]+\b", f.read_text())}
    assert read - flags - entrypoint.READ_BY_HKSERVE == set()


def test_switches_take_yes_and_no_and_refuse_anything_else():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True)
    assert entrypoint.flags_from_env(parser, {"HKSERVE_QUIET": "yes", "HKSERVE_WARM": "0"}) == ["--quiet", "--no-warm"]
    assert entrypoint.flags_from_env(parser, {"HKSERVE_QUIET": "off"}) == []
    with pytest.raises(SystemExit, match="HKSERVE_QUIET"):
        entrypoint.flags_from_env(parser, {"HKSERVE_QUIET": "maybe"})


def test_serves_with_the_arguments_after_the_variables_or_runs_another_command(monkeypatch):
    calls = []
    monkeypatch.setattr(entrypoint.os, "execvp", lambda file, argv: calls.append(argv))
    monkeypatch.setattr(entrypoint.os, "environ", {"HKSERVE_SLOTS": "4"})
    entrypoint.main(["--slots", "8"])
    entrypoint.main(["hkserve", "pull", "smollm2-135m-instruct"])
    assert calls == [["hkserve", "serve", "--slots=4", "--slots", "8"], ["hkserve", "pull", "smollm2-135m-instruct"]]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_health_check_follows_health_and_is_ok_on_a_follower_host():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = str(server.server_address[1])
    try:
        assert healthcheck.main({"HKSERVE_PORT": port}) == 0
        _Health.status = 503  # loading, draining or a lost host
        assert healthcheck.main({"HKSERVE_PORT": port}) == 1
    finally:
        server.shutdown()
        server.server_close()
        _Health.status = 200
    with socket.socket() as closed:  # bound, not listening: the connection is refused
        closed.bind(("127.0.0.1", 0))
        assert healthcheck.main({"HKSERVE_PORT": str(closed.getsockname()[1])}) == 1
        assert healthcheck.main({"HKSERVE_PORT": str(closed.getsockname()[1]), "HKSERVE_HOST_ID": "1"}) == 0
