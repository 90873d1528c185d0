"""`hkserve sample` for tests/test_sample.py, holding after a given number of output lines: the first
argument is that number. Once that many lines are written, the writer prints "held" on stdout and
blocks for good, so a kill lands after exactly that many lines whatever the machine's speed."""

from __future__ import annotations

import sys
import threading

from tqdm import tqdm

import hkserve.cli.sample as sample_cli
from hkserve.cli.main import main

HOLD_AFTER = int(sys.argv.pop(1))


class HeldBar(tqdm):
    """The progress bar, updated once per line written (after the line is flushed)."""

    written = 0

    def update(self, n=1):
        super().update(n)
        HeldBar.written += n
        if HeldBar.written == HOLD_AFTER:
            print("held", flush=True)
            threading.Event().wait()


sample_cli.tqdm = HeldBar

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
