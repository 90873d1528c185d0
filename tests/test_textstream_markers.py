"""Stop strings against kept special markers (`keep`: Mistral's `[TOOL_CALLS]`, written out for the
tool parser and hidden from clients): a stop matches only the text a client sees, so the released text
without its markers is, token by token, what a stream that skips the markers releases (the reference:
TextStream without `keep`, the behaviour before markers were kept)."""

from __future__ import annotations

import random

import pytest
from special_tokenizer import ARGS, PYTHON_TAG, TOKENIZER, TOOL_CALLS, ids, special_tokenizer

from hkserve.engine.textstream import TextStream

MARKERS = (TOOL_CALLS, ARGS, PYTHON_TAG)
KEEP = frozenset(ids(list(MARKERS)))
MISTRAL = ["Sure.", TOOL_CALLS, "get_weather", ARGS, '{"city": "Paris"}']


def hide(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


def run(token_ids: list[int], stop: list[str], keep: frozenset[int]) -> tuple[list[str], TextStream]:
    """The text released so far after each token and at the end, and the stream."""
    stream, released = TextStream(TOKENIZER, stop, keep), []
    for token in token_ids:
        stream.add(token)
        released.append(stream.text)
    stream.finish()
    return released + [stream.text], stream


@pytest.mark.parametrize("stop", [["["], ["TOOL"], ["[T"], ["CALLS]"], ["ARGS"], ["<|"], [TOOL_CALLS]])
def test_a_stop_inside_a_kept_markers_text_never_matches_it(stop):
    released, stream = run(ids(MISTRAL), stop, KEEP)
    assert released[-1] == "".join(MISTRAL) and not stream.stopped and stream.stopped_by is None


def test_a_stop_in_the_visible_text_ends_it_where_it_would_without_the_markers():
    _, stream = run(ids(MISTRAL), ["Paris"], KEEP)
    assert (stream.text, stream.stopped_by) == ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "', "Paris")
    _, stream = run(ids(MISTRAL), ["get"], KEEP)  # a marker before the stop is released, as the text before it
    assert (stream.text, stream.stopped_by) == ("Sure.[TOOL_CALLS]", "get")
    _, stream = run(ids(["a", TOOL_CALLS, "b"]), ["ax", "b"], KEEP)  # held after "a", then the stop "b"
    assert (stream.text, stream.stopped_by) == ("a[TOOL_CALLS]", "b")
    _, stream = run(ids(["ab", TOOL_CALLS, "cd"]), ["bc"], KEEP)  # a stop across a marker: the client sees "abcd"
    assert (stream.text, stream.stopped_by) == ("a", "bc")


def test_a_marker_that_begins_another_is_never_taken_for_the_longer_ones_start():
    """The longer marker is hidden whole: were `<m>` cut from `<m>more>` first, the client would be
    taken to see "more>" and the stop "more" would end the reply at a marker."""
    tokenizer = special_tokenizer(("<m>", "<m>more>"))
    short, long = tokenizer.special_id("<m>"), tokenizer.special_id("<m>more>")
    stream = TextStream(tokenizer, ["more"], frozenset({short, long}))
    for token in [*tokenizer.encode("a"), long, *tokenizer.encode("b"), short, *tokenizer.encode("c")]:
        stream.add(token)
    stream.finish()
    assert stream.text == "a<m>more>b<m>c" and not stream.stopped and stream.stopped_by is None


def test_a_held_stop_prefix_holds_the_markers_inside_it_and_releases_them_with_it():
    released, stream = run(ids(["x[", TOOL_CALLS, "y"]), ["[y", "[z"], KEEP)
    assert released == ["x"] * 5 and (stream.text, stream.stopped_by) == ("x", "[y")
    released, stream = run(ids(["x[", TOOL_CALLS, "w"]), ["[y"], KEEP)
    assert released == ["x", "x", "x", "x[[TOOL_CALLS]w", "x[[TOOL_CALLS]w"] and not stream.stopped


def test_token_by_token_the_client_text_is_the_reference_streams():
    """Random replies of text and markers against random stop strings (substrings of the visible text,
    pieces of the markers): after every token, the released text less its markers is the reference's."""
    rng = random.Random(40)
    alphabet = ["a", "b", "[", "]", "T", "O", " ", "|", "<", "_"]
    for _ in range(300):
        pieces = [
            rng.choice(alphabet) if rng.random() < 0.8 else rng.choice(MARKERS) for _ in range(rng.randint(0, 14))
        ]
        visible = hide("".join(pieces))
        stop = [rng.choice(["[", "TOOL", "[T", "]", "ARGS]", "<|", "_"])]
        if visible and rng.random() < 0.6:
            at = rng.randrange(len(visible))
            stop.append(visible[at : at + rng.randint(1, 3)])
        released, stream = run(ids(pieces), stop, KEEP)
        reference, expected = run(ids(pieces), stop, frozenset())
        assert [hide(t) for t in released] == reference, (pieces, stop)
        assert (stream.stopped, stream.stopped_by) == (expected.stopped, expected.stopped_by), (pieces, stop)
