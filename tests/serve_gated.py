"""`hkserve serve` for tests/test_serve.py, with two gates the test opens by writing lines to stdin, so
it can look at the server in states that otherwise pass too quickly to catch for certain:

  * the warm-up starts only after the first line: until then the server is up but loading (503);
  * after warm-up, the third decode step waits for the second line: a stream stops mid-way.
"""

from __future__ import annotations

import sys

from hkserve.cli.main import main
from hkserve.engine.engine import Engine

_warmup, _step = Engine.warmup, Engine.step
_decode_steps = 0
_warm = False


def gated_warmup(self, *args) -> None:
    global _warm
    sys.stdin.readline()
    _warmup(self, *args)  # its own steps are not counted
    _warm = True


def gated_step(self, active):
    global _decode_steps
    if _warm:
        _decode_steps += 1
        if _decode_steps == 3:
            sys.stdin.readline()
    return _step(self, active)


Engine.warmup, Engine.step = gated_warmup, gated_step

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
