"""A `json_object` reply cut by its token budget still parses.

The grammar alone only keeps a reply on the path of valid JSON; a reply that reaches max_tokens (or the
slot's context) in the middle of a long string would end as an unclosed fragment. Near the end of the
budget, `JsonBudget.restrict` removes from a row's bitmask every token after which the JSON could no
longer be closed in the tokens left: the shortest closing text (end the string, give a pending key the
value 0, close each open object and array) is counted in characters, an upper bound on its tokens.
Far from the end it changes nothing, so a reply that fits its budget is exactly what the model wrote.

The tracker follows the JSON the grammar allows with hkserve's separators (", " and ": ", no other
whitespace; constrained.JSON_OPTIONS). State: a tuple, so that trying a token is a cheap copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Phases of the innermost open container (a frame: (kind, phase), kind "o" object or "a" array).
KEY_OR_END, KEY, COLON, COLON_SPACE, VALUE, AFTER, COMMA_SPACE, VALUE_OR_END = range(8)
# What each phase still needs written to close its container (the text after the open scalar's end).
CLOSE_OBJECT = {KEY_OR_END: "}", KEY: '"": 0}', COLON: ": 0}", COLON_SPACE: " 0}", VALUE: "0}", AFTER: "}"}
CLOSE_OBJECT[COMMA_SPACE] = ' "": 0}'
CLOSE_ARRAY = {VALUE_OR_END: "]", VALUE: "0]", AFTER: "]", COMMA_SPACE: " 0]"}
LITERALS = {ord("t"): "rue", ord("f"): "alse", ord("n"): "ull"}
NUMBER = frozenset(b"0123456789.eE+-")
HEX = frozenset(b"0123456789abcdefABCDEF")
LOST = None  # text the tracker does not follow (the grammar would not have allowed it)


class Scalar(NamedTuple):
    """The value being written: "s" string (escape: 0 none, 1 after a backslash, 2 + k after \\u and k
    hex digits; key: whether it is an object key; utf8: continuation bytes its last character still
    needs), "n" number (its last byte), "l" literal (the letters still to come)."""

    kind: str
    escape: int = 0
    key: bool = False
    last: int = 0
    rest: str = ""
    utf8: int = 0


class State(NamedTuple):
    frames: tuple[tuple[str, int], ...] = ()  # open containers, outermost first
    scalar: Scalar | None = None
    done: bool = False  # the top-level value is complete


def _value_done(state: State) -> State:
    if not state.frames:
        return State(done=True)
    kind, _ = state.frames[-1]
    return State(state.frames[:-1] + ((kind, AFTER),))


def _start_value(frames: tuple, byte: int) -> State | None:
    if byte == ord("{"):
        return State(frames + (("o", KEY_OR_END),))
    if byte == ord("["):
        return State(frames + (("a", VALUE_OR_END),))
    if byte == ord('"'):
        return State(frames, Scalar("s"))
    if byte == ord("-") or ord("0") <= byte <= ord("9"):
        return State(frames, Scalar("n", last=byte))
    if byte in LITERALS:
        return State(frames, Scalar("l", rest=LITERALS[byte]))
    return LOST


def _scalar_byte(state: State, byte: int) -> tuple[bool, State | None]:
    """A byte while a scalar is open → (whether the scalar took it, the state). A number does not take
    the byte after it: that byte is then structure."""
    s = state.scalar
    if s.kind == "s":
        if s.escape == 1:
            return True, state._replace(scalar=s._replace(escape=2 if byte == ord("u") else 0))
        if s.escape >= 2:
            if byte not in HEX:
                return True, LOST
            return True, state._replace(scalar=s._replace(escape=0 if s.escape == 5 else s.escape + 1))
        if s.utf8:
            return True, state._replace(scalar=s._replace(utf8=s.utf8 - 1)) if 0x80 <= byte < 0xC0 else LOST
        if byte >= 0xC0:
            return True, state._replace(scalar=s._replace(utf8=1 if byte < 0xE0 else 2 if byte < 0xF0 else 3))
        if byte == ord("\\"):
            return True, state._replace(scalar=s._replace(escape=1))
        if byte != ord('"'):
            return True, state
        if s.key:
            kind, _ = state.frames[-1]
            return True, State(state.frames[:-1] + ((kind, COLON),))
        return True, _value_done(State(state.frames))
    if s.kind == "l":
        if byte != ord(s.rest[0]):
            return True, LOST
        rest = s.rest[1:]
        return True, _value_done(State(state.frames)) if not rest else state._replace(scalar=s._replace(rest=rest))
    if byte in NUMBER:
        return True, state._replace(scalar=s._replace(last=byte))
    if s.last in b"-.eE+":
        return True, LOST  # an unfinished number cannot end here
    return False, _value_done(State(state.frames))


def _structure_byte(state: State, byte: int) -> State | None:
    """A byte outside any scalar: starts a value, a key, or moves the innermost container's phase."""
    frames = state.frames
    if not frames:
        return _start_value(frames, byte)
    kind, phase = frames[-1]
    inner = frames[:-1]
    closes = byte == ord("}" if kind == "o" else "]")
    if closes and phase in (KEY_OR_END, VALUE_OR_END, AFTER):
        return _value_done(State(inner))
    if phase in (VALUE, VALUE_OR_END):
        return _start_value(inner + ((kind, AFTER),), byte)
    if phase in (KEY_OR_END, KEY) and byte == ord('"'):
        return State(frames, Scalar("s", key=True))
    step = {(COLON, ":"): COLON_SPACE, (COLON_SPACE, " "): VALUE, (AFTER, ","): COMMA_SPACE}
    step[(COMMA_SPACE, " ")] = KEY if kind == "o" else VALUE
    after = step.get((phase, chr(byte)))
    return LOST if after is None else State(inner + ((kind, after),))


def feed(state: State | None, data: bytes) -> State | None:
    """The state after `data`; LOST if the tracker cannot follow it."""
    for byte in data:
        if state is LOST or state.done:
            return LOST
        if state.scalar is not None:
            took, state = _scalar_byte(state, byte)
            if took:
                continue
            if state.done:  # a top-level number, then more
                return LOST
        state = _structure_byte(state, byte)
    return state


def need(state: State) -> int:
    """Characters (an upper bound on tokens) that complete the JSON value from `state`."""
    pending = state.scalar.utf8 if state.scalar is not None else 0
    return pending + len(closing(state))


def closing(state: State) -> str:
    """The shortest text that completes the JSON value from `state` ("{}" before it starts), once the
    character being written (if a string's is unfinished) is whole."""
    if not state.frames and state.scalar is None:
        return "" if state.done else "{}"
    text, frames = "", list(state.frames)
    s = state.scalar
    if s is not None:
        if s.kind == "s":
            text = ("n" if s.escape == 1 else "0" * (6 - s.escape) if s.escape >= 2 else "") + '"'
            if s.key:
                kind, _ = frames.pop()
                frames.append((kind, COLON))
        elif s.kind == "l":
            text = s.rest
        elif s.last in b"-.eE+":
            text = "0"
    for kind, phase in reversed(frames):
        text += (CLOSE_OBJECT if kind == "o" else CLOSE_ARRAY)[phase]
    return text


def growth_bound(data: bytes) -> int:
    """At most how many characters `data` can add to the closing text, from any state: a comma 6
    (`, ` then a key: ` "": 0`; of a run of commas only the last, as `,,` can only be string text), a
    quote 4 (a key: `": 0`), a backslash 4 (`\\u` and four digits), a literal begun where an array
    could end 4 (`[f` needs `alse]`, not `]`), a leading `u` 3 (a `\\u` whose backslash ended the token
    before), an unfinished last character 3 (UTF-8), an opening bracket 1, an unfinished number 1."""
    commas = sum(b == ord(",") and data[i + 1 : i + 2] != b"," for i, b in enumerate(data))
    literals = sum(b in b"tfn" and (i == 0 or data[i - 1] in b" [") for i, b in enumerate(data))
    bound = 6 * commas + 4 * (data.count(b'"') + data.count(b"\\") + literals)
    bound += 3 * any(b >= 0xC0 for b in data) + data.count(b"{") + data.count(b"[")
    return bound + 3 * data.startswith(b"u") + any(b in b".eE+-" for b in data)


def _plain_text(data: bytes) -> bool:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return False
    return not any(c in '"\\' or c < " " for c in text)


class JsonVocab:
    """What the budget needs of each token id: its bytes, whether it can sit inside a string without
    changing the closing text (whole UTF-8 characters, no quote, backslash or control byte), and
    `reach`, the most closing characters one token can add (`growth_bound`)."""

    def __init__(self, token_bytes: list[bytes], special: np.ndarray):
        self.token_bytes = token_bytes
        self.in_string = np.asarray([_plain_text(t) for t in token_bytes]) & ~special
        self.special = special
        self.reach = max((growth_bound(t) for t, s in zip(token_bytes, special) if not s), default=0)


class JsonBudget:
    """One json_object request's tracker: `feed` each token it emits, `restrict` its next bitmask row."""

    def __init__(self, vocab: JsonVocab):
        self.vocab = vocab
        self.state: State | None = State()

    def feed(self, token_id: int) -> None:
        if self.state is not LOST and not self.vocab.special[token_id]:
            self.state = feed(self.state, self.vocab.token_bytes[token_id])

    def restrict(self, row: np.ndarray, remaining: int) -> bool:
        """Clear in `row` [W] int32 the tokens after which the JSON could not close in `remaining` - 1
        tokens (remaining counts this one) → whether any was cleared. Nothing changes far from the
        budget's end, or if the tracker lost the text, or if no allowed token would be left."""
        if self.state is LOST:
            return False
        needed = need(self.state)
        if remaining > needed + self.vocab.reach:
            return False
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: len(self.vocab.token_bytes)].astype(bool)
        keep = np.zeros_like(bits)
        scalar = self.state.scalar
        try_each = bits
        if scalar is not None and scalar.kind == "s" and scalar.escape == scalar.utf8 == 0:  # need stays
            keep = bits & self.vocab.in_string & (needed <= remaining - 1)
            try_each = bits & ~self.vocab.in_string
        for token_id in np.flatnonzero(try_each):
            if self.vocab.special[token_id]:
                keep[token_id] = True  # EOS: the grammar allows it only once the JSON is complete
                continue
            after = feed(self.state, self.vocab.token_bytes[token_id])
            keep[token_id] = after is not LOST and need(after) <= remaining - 1
        if not keep.any() or (keep == bits).all():
            return False
        packed = np.packbits(np.pad(keep, (0, row.size * 32 - keep.size)), bitorder="little")
        row[:] = packed.view(np.int32)
        return True
