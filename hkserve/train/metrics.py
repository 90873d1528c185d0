"""The JSONL metrics log: one line per optimizer step, one per validation.

A resumed run re-does the steps after its checkpoint, so their lines from the interrupted run are
dropped first: the file then reads like one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path | None, resume_step: int = 0):
        self._file = None
        if path is None:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.is_file() and resume_step > 0:
            kept = [
                line for line in path.read_text().splitlines() if _step(line) is not None and _step(line) <= resume_step
            ]
        path.write_text("".join(line + "\n" for line in kept))
        self._file = path.open("a")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _step(line: str) -> int | None:
    """The step of a logged line; None for a torn last line left by a kill."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
