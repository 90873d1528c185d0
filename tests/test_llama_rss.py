"""`hkserve bench startup --llama-gguf`: llama-cpp-python is optional, so the option is refused with a clear
message (exit code 2) before any server starts when it is missing, or when the file is not there."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from hkserve.bench import llama_rss, startup


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    startup.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_server(monkeypatch):
    """Fails the test if a start is attempted: the refusal must come first."""

    def start(*_):
        raise AssertionError("a server was started")

    monkeypatch.setattr(startup, "start_once", start)
    monkeypatch.setattr(startup, "ModelStore", start)


def test_llama_option_refused_without_llama_cpp(monkeypatch, capsys, no_server, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert startup.run(parsed("--llama-gguf", str(gguf))) == 2
    assert llama_rss.MISSING in capsys.readouterr().err


def test_llama_option_refused_for_a_missing_file(monkeypatch, capsys, no_server, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if installed
    assert startup.run(parsed("--llama-gguf", str(tmp_path / "absent.gguf"))) == 2
    assert "no such file" in capsys.readouterr().err
