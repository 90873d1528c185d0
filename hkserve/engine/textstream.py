"""Token ids → the text a client sees: UTF-8 safe, stop strings matched across token boundaries.

Text that could still be the beginning of a stop string is held back until it is decided, so a
stop string never leaks into a stream, even in part.

Kept special markers (`keep`: Mistral's `[TOOL_CALLS]`, read by a reply parser) are in the released text
but never in what a client sees, so stop strings match the text without them: a stop `[` or `TOOL` does
not end a reply at a marker the client cannot see, and a stop ends it exactly where it would without
`keep` (a marker right before the stop is dropped with it).
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
        # the kept ids' texts, longest first: what a client never sees, so no stop string matches in them
        self.markers = sorted({tokenizer.decode([i], keep=keep) for i in keep}, key=len, reverse=True)
        self.stop = [s for s in stop or [] if s]
        self.held = ""  # decoded text not released yet
        self.text = ""  # everything released
        self.stopped = False
        self.stopped_by: str | None = None  # the stop string that matched, once one did

    def _visible(self) -> tuple[str, list[int]]:
        """The held text as a client sees it (without the markers), and each of its characters' offset in
        the held text."""
        if not self.markers:
            return self.held, list(range(len(self.held)))
        chars: list[str] = []
        starts: list[int] = []
        at = 0
        while at < len(self.held):
            marker = next((m for m in self.markers if self.held.startswith(m, at)), None)
            if marker is not None:
                at += len(marker)
                continue
            chars.append(self.held[at])
            starts.append(at)
            at += 1
        return "".join(chars), starts

    def _release(self, final: bool) -> Piece:
        visible, starts = self._visible()
        hits = [(visible.find(s), s) for s in self.stop if s in visible]
        if hits:  # the earliest match wins
            index, self.stopped_by = min(hits)
            out, self.held, self.stopped = self.held[: starts[index]], "", True
            self.text += out
            return Piece(out, True)
        keep = 0 if final else self._possible_stop_prefix(visible)
        cut = starts[len(visible) - keep] if keep else len(self.held)  # held from the possible stop's start
        out, self.held = self.held[:cut], self.held[cut:]
        self.text += out
        return Piece(out, False)

    def _possible_stop_prefix(self, visible: str) -> int:
        """Length of the longest suffix of the visible held text that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(visible)), best, -1):
                if visible.endswith(s[:k]):
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
