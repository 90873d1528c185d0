"""Incremental detokenization: turn a growing list of token ids into text deltas, UTF-8 safe.

Byte-level BPE can split one character over several tokens; decoding a prefix then shows U+FFFD.
A delta is released only once the text decodes cleanly, and only text not released before.
Special tokens decode as nothing, except the `keep` ids: markers a reply parser must read (Mistral's
`[TOOL_CALLS]`, Llama's `<|python_tag|>`), which the API layer takes out of what clients see.
"""

from __future__ import annotations

from hkserve.checkpoint.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, context: int = 6, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.keep = keep  # special ids written out as text
        self.ids: list[int] = []
        self.context = context  # tokens decoded before the new ones, so word-boundary spaces come out right
        self.prefix = 0  # start of the decode window in ids
        self.read = 0  # ids before this index have been released as text

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(int(token_id))
        before, after = self._window()
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # incomplete character, or a token that renders as nothing (special)
        self.read = len(self.ids)
        self.prefix = max(0, self.read - self.context)
        # `before` is a prefix of `after` for these tokenizers; slice by its length.
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end (an unfinished character is emitted as decoded)."""
        before, after = self._window()
        self.read = len(self.ids)
        return after[len(before) :]

    def _window(self) -> tuple[str, str]:
        """The decode window's text without and with the ids not yet released."""
        decode = self.tokenizer.decode
        return decode(self.ids[self.prefix : self.read], keep=self.keep), decode(
            self.ids[self.prefix :], keep=self.keep
        )
