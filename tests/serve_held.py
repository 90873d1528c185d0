"""`hkserve serve` for tests/test_web_page.py, with a gate the test works by writing lines to stdin, so a
reply can be caught mid-stream for certain (no timing guesses):

  * `hold N TAG`: the N-th decode step from now waits, after printing `step held TAG`, until the line
    `go`;
  * a runner cancel while a step is held prints `cancel during hold TAG` first (the server saw the
    client leave while its reply was still running).
"""

from __future__ import annotations

import sys
import threading

from hkserve.cli.main import main
from hkserve.engine.engine import Engine
from hkserve.engine.runner import InferenceRunner

_step, _cancel = Engine.step, InferenceRunner.cancel
_lock = threading.Lock()
_gate = {"countdown": 0, "tag": ""}  # steps until the held one (0: none armed), and its name
_go = threading.Event()
_holding = threading.Event()


def _commands() -> None:
    for line in sys.stdin:
        word, *rest = line.split()
        with _lock:
            if word == "hold":
                _go.clear()
                _gate["countdown"], _gate["tag"] = int(rest[0]), rest[1]
            elif word == "go":
                _go.set()


def held_step(self, active):
    with _lock:
        hold = _gate["countdown"] == 1
        _gate["countdown"] = max(0, _gate["countdown"] - 1)
    if hold:
        _holding.set()
        print(f"step held {_gate['tag']}", flush=True)
        _go.wait()
        _holding.clear()
    return _step(self, active)


def noted_cancel(self, request_id: str) -> None:
    if _holding.is_set():
        print(f"cancel during hold {_gate['tag']}", flush=True)
    _cancel(self, request_id)


Engine.step, InferenceRunner.cancel = held_step, noted_cancel

if __name__ == "__main__":
    threading.Thread(target=_commands, daemon=True).start()
    sys.exit(main(sys.argv[1:]))
