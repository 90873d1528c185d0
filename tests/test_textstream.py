"""Token ids → client text, token by token: UTF-8 safe deltas and stop strings held back until decided.

A stand-in tokenizer keeps these tests exact and fast: every token is a byte string (one character
may span two tokens), id 0 is a control token that decodes to nothing (to `<ctl>` when kept), and, as
with SentencePiece, decoding drops one leading space, so a token decoded without its predecessors loses
its word space."""

from __future__ import annotations

from hkserve.engine.detokenize import IncrementalDetokenizer
from hkserve.engine.textstream import TextStream

PIECES = [b"", b" Hello", b" wor", b"ld", b"!", b"\xf0\x9f", b"\x8c\x8d", b" the", b" end", b" xyz abc xyz"]
CONTROL, HELLO, WOR, LD, BANG, GLOBE_1, GLOBE_2, THE, END, XYZ_ABC = range(len(PIECES))
SENTENCE = [HELLO, WOR, LD, BANG, GLOBE_1, GLOBE_2, CONTROL, THE, END]  # "Hello world!🌍 the end"


class PieceTokenizer:
    def __init__(self):
        self.longest_decode = 0  # most ids decoded at once

    def decode(self, ids: list[int], keep: frozenset[int] = frozenset()) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        text = b"".join(b"<ctl>" if i in keep else PIECES[i] for i in ids).decode("utf-8", errors="replace")
        return text.removeprefix(" ")


def deltas(ids: list[int], context: int = 6, tokenizer: PieceTokenizer | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer or PieceTokenizer(), context)
    return [detok.add(i) for i in ids] + [detok.flush()]


def pieces(stop: list[str] | None, ids: list[int]) -> tuple[list[tuple[str, bool]], str, TextStream]:
    """(text, stopped) released per token, the text released at the end, and the stream."""
    stream = TextStream(PieceTokenizer(), stop)
    released = [tuple(stream.add(i)) for i in ids]
    return released, stream.finish(), stream


def test_deltas_hold_split_characters_and_keep_word_spaces_past_the_context():
    assert deltas(SENTENCE) == ["Hello", " wor", "ld", "!", "", "🌍", "", " the", " end", ""]
    tokenizer = PieceTokenizer()
    assert "".join(deltas(SENTENCE, 1, tokenizer)) == "Hello world!🌍 the end"  # one token of context suffices
    assert tokenizer.longest_decode == 3  # the context and the two halves of "🌍": no re-decoding from the start


def test_a_kept_special_token_is_released_as_text_and_the_others_as_nothing():
    detok = IncrementalDetokenizer(PieceTokenizer(), keep=frozenset({CONTROL}))
    kept = [detok.add(i) for i in SENTENCE]
    assert kept == ["Hello", " wor", "ld", "!", "", "🌍", "<ctl>", " the", " end"]
    stream = TextStream(PieceTokenizer(), None, keep=frozenset({CONTROL}))
    assert [stream.add(i).text for i in (HELLO, CONTROL, THE)] == ["Hello", "<ctl>", " the"]


def test_an_unfinished_character_is_flushed_as_decoded_and_only_once():
    detok = IncrementalDetokenizer(PieceTokenizer())
    assert [detok.add(HELLO), detok.add(GLOBE_1)] == ["Hello", ""]
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
    assert detok.add(BANG) == "!"


def test_without_stop_strings_text_is_released_as_it_decodes():
    for stop in (None, [], [""]):  # an empty stop string is ignored, not matched everywhere
        released, tail, stream = pieces(stop, SENTENCE)
        assert released == [
            ("Hello", False),
            (" wor", False),
            ("ld", False),
            ("!", False),
            ("", False),
            ("🌍", False),
            ("", False),
            (" the", False),
            (" end", False),
        ]
        assert tail == "" and stream.text == "Hello world!🌍 the end" and not stream.stopped
        assert stream.stopped_by is None  # no stop string matched (Anthropic: stop_sequence null)


def test_stop_string_across_tokens_is_held_back_then_dropped():
    released, tail, stream = pieces([" world", "zzz"], SENTENCE)
    assert released[:3] == [("Hello", False), ("", False), ("", True)]
    assert released[3:] == [("", True)] * 6  # tokens the engine made after the stop: nothing more
    assert tail == "" and stream.text == "Hello" and stream.stopped


def test_a_prefix_that_turns_out_not_to_be_a_stop_is_released_whole():
    released, tail, stream = pieces(["ld!!", "!x"], SENTENCE)
    # "ld" and "ld!" could begin "ld!!" (and "!" could begin "!x"): held until "🌍" decides
    assert released[:6] == [("Hello", False), (" wor", False), ("", False), ("", False), ("", False), ("ld!🌍", False)]
    assert stream.text + tail == "Hello world!🌍 the end" and not stream.stopped


def test_held_text_is_released_when_generation_ends_without_the_stop():
    released, tail, stream = pieces(["ld!!"], [HELLO, WOR, LD, BANG])
    assert [text for text, _ in released] == ["Hello", " wor", "", ""]
    assert tail == "ld!" and stream.text == "Hello world!"


def test_the_longest_possible_stop_prefix_is_held():
    # held "Hello wor" ends with "wor" (could begin "world peace") and "r" (could begin "rx")
    released, _, _ = pieces(["rx", "world peace"], [HELLO, WOR])
    assert released == [("Hello", False), (" ", False)]


def test_the_earliest_of_several_stop_strings_wins():
    released, tail, stream = pieces(["abc", "xyz"], [HELLO, XYZ_ABC])  # " xyz abc xyz" in one token
    assert released == [("Hello", False), (" ", True)]
    assert tail == "" and stream.text == "Hello "
