"""Token ids → the text a client sees: UTF-8 safe, stop strings matched across token boundaries.

Text that could still be the beginning of a stop string is held back until it is decided, so a
stop string never leaks into a stream, even in part.
"""

from __future__ import annotations

from typing import NamedTuple

from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.detokenize import IncrementalDetokenizer


class Piece(NamedTuple):
    text: str  # text released by this token (may be empty)
    stopped: bool  # a stop string matched: the request is finished, text ends before it


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None, keep: frozenset[int] = frozenset()):
        """`keep`: special ids whose text is released (IncrementalDetokenizer)."""
        self.detok = IncrementalDetokenizer(tokenizer, keep=keep)
        self.stop = [s for s in stop or [] if s]
        self.held = ""  # decoded text not released yet
        self.text = ""  # everything released
        self.stopped = False
        self.stopped_by: str | None = None  # the stop string that matched, once one did

    def _release(self, final: bool) -> Piece:
        hits = [(self.held.find(s), s) for s in self.stop if s in self.held]
        if hits:  # the earliest match wins
            index, self.stopped_by = min(hits)
            out, self.held, self.stopped = self.held[:index], "", True
            self.text += out
            return Piece(out, True)
        keep = 0 if final else self._possible_stop_prefix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        self.text += out
        return Piece(out, False)

    def _possible_stop_prefix(self) -> int:
        """Length of the longest suffix of the held text that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.held)), best, -1):
                if self.held.endswith(s[:k]):
                    best = k
                    break
        return best

    def add(self, token_id: int) -> Piece:
        if self.stopped:
            return Piece("", True)
        self.held += self.detok.add(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of generation: release what was held (no stop string completed)."""
        if self.stopped:
            return ""
        self.held += self.detok.flush()
        return self._release(final=True).text
