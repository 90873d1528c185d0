"""constrained.py's host side without a model: the grammars compiled from each kind of spec and the
refusals, the llguidance view of a SentencePiece tokenizer, and the runner's table of constrained
slots (first-token masks, per-row masks of a step, advancing, the json_object budget, the timing
hook). Fast and fixture-free: `make mutate`'s in-process driver runs it per mutant."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from hkserve.checkpoint.tokenizer import CONTROL, NORMAL, UNKNOWN, Tokenizer, _sentencepiece_from_vocab
from hkserve.engine.constrained import (
    Advance,
    Grammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    SlotGrammars,
    _SentencePieceView,
    bitmask_words,
    full_bitmask,
    grammar_text,
    json_vocab,
    ll_tokenizer,
)
from hkserve.engine.json_budget import JsonVocab
from hkserve.train.vocab import byte_tokenizer

TOKENIZER = byte_tokenizer()  # id = byte + 3; 0 <unk>, 1 <s>, 2 </s> (EOS)
VOCAB = 300  # the model's table: ids 259.. are padding
COMPILER = GrammarCompiler(TOKENIZER, VOCAB)
EOS = TOKENIZER.eos_id


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_bos=False)


def allowed(row: np.ndarray) -> set[int]:
    """The token ids a bitmask row [W] allows."""
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def test_bitmask_words_and_the_full_mask():
    assert [bitmask_words(v) for v in (1, 31, 32, 33, 64, 65)] == [1, 1, 1, 2, 2, 3]
    mask = full_bitmask(3, 33)
    assert mask.shape == (3, 2) and mask.dtype == np.int32 and (mask == -1).all()


def whole(grammar, text: str) -> bool:
    """Whether the grammar takes exactly `text`, then EOS."""
    matcher, text_ids = grammar.matcher(), ids(text)
    if matcher.validate_tokens(text_ids) != len(text_ids):
        return False
    return matcher.consume_tokens(text_ids) and matcher.consume_token(EOS) and matcher.is_stopped()


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (GrammarSpec("json_object"), '{"a": [1, 2]}', '{"a":1}'),
        (GrammarSpec("json_schema", '{"type": "integer"}'), "42", '"42"'),
        (GrammarSpec("regex", "(ab|cd){2}"), "abcd", "abc"),
        (GrammarSpec("choice", '["yes", "no"]'), "no", "maybe"),
        (GrammarSpec("lark", 'start: "x" NUM\nNUM: /[0-9]+/'), "x12", "x"),
    ],
)
def test_each_kind_compiles_to_a_grammar_of_what_it_says(spec, good, bad):
    grammar = COMPILER.compile(spec)
    assert grammar.spec == spec and grammar.tokenizer is COMPILER.ll
    assert (grammar.json_vocab is not None) == (spec.kind == "json_object")
    assert whole(grammar, good) and not whole(grammar, bad)


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec("json_schema", "{"), "the JSON schema is not valid JSON: "),
        (GrammarSpec("json_schema", "[1]"), "the JSON schema must be an object"),
        (GrammarSpec("json_schema", "3"), "the JSON schema must be an object"),
        (GrammarSpec("json_schema", "true"), "invalid JSON schema: "),  # refused by llguidance with the options
        (GrammarSpec("json_schema", '{"type": "integer", "minimum": "x"}'), "invalid json schema: "),
        (GrammarSpec("choice", "[]"), "choice must be a non-empty list of non-empty strings"),
        (GrammarSpec("choice", '["a", ""]'), "choice must be a non-empty list of non-empty strings"),
        (GrammarSpec("choice", '["a", 1]'), "choice must be a non-empty list of non-empty strings"),
        (
            GrammarSpec("xml", "<a/>"),
            "unknown grammar kind 'xml' (one of json_object, json_schema, regex, choice, lark)",
        ),
        (GrammarSpec("regex", "(ab"), "invalid regex: "),
        (GrammarSpec("lark", "start: missing_rule"), "invalid lark: "),
        (GrammarSpec("lark", "start: <[400]>"), "invalid lark: "),  # past the vocabulary: only the tokenizer knows
    ],
)
def test_a_grammar_llguidance_refuses_is_a_grammar_error_naming_why(spec, message):
    with pytest.raises(GrammarError) as e:
        COMPILER.compile(spec)
    text = str(e.value)  # a message ending ": " goes on with llguidance's or json's reason
    assert text.startswith(message) and len(text) > len(message) if message.endswith(": ") else text == message
    assert isinstance(e.value, ValueError)  # the API turns it into a 400


def test_grammar_texts_are_llguidance_grammars_and_the_json_options_apply():
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    for spec, kind in (
        (GrammarSpec("json_object"), "object"),
        (GrammarSpec("json_schema", '{"type": "integer"}'), "integer"),
    ):
        schema = json.loads(grammar_text(spec))["grammars"][0]["json_schema"]
        assert schema == {"type": kind, "x-guidance": options}


def test_the_compiler_builds_its_llguidance_tokenizer_once_and_shares_the_json_vocabulary():
    compiler = GrammarCompiler(TOKENIZER, VOCAB)
    assert compiler.ll is compiler.ll and compiler.ll.vocab_size == VOCAB
    first, second = (compiler.compile(GrammarSpec("json_object")) for _ in range(2))
    assert isinstance(first.json_vocab, JsonVocab) and first.json_vocab is second.json_vocab
    assert first.tokenizer is compiler.ll


def test_the_llguidance_view_of_a_sentencepiece_tokenizer():
    view = _SentencePieceView(TOKENIZER, VOCAB)
    assert (view.eos_token_id, view.bos_token_id, view.special_token_ids) == (2, 1, [1, 2])
    assert view.tokens[1:3] == [b"<s>", b"</s>"] and view.tokens[ord("a") + 3] == b"a"
    assert len(view.tokens) == VOCAB and view.tokens[259:] == [b""] * 41  # padding ids spell nothing
    assert view("héllo") == ids("héllo") and view(b"\xff") == [0xFF + 3]
    assert view("<s>") == ids("<s>")  # text is spelled by plain tokens, never by a special one
    ll = ll_tokenizer(TOKENIZER, VOCAB)
    assert ll.vocab_size == VOCAB and ll.eos_token == EOS and ll.is_special_token(1) and not ll.is_special_token(100)


def test_a_sentencepiece_view_takes_the_longest_piece_and_skips_bytes_no_piece_spells():
    pieces = ["<unk>", "<s>", "</s>", "a", "b", "ab", "abc", "▁x"]
    types = [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * 5
    backend = _sentencepiece_from_vocab(pieces, [0.0] * 8, types, False, {"bos": 1, "eos": 2, "padding": None})
    view = _SentencePieceView(Tokenizer("sentencepiece", backend, bos_id=1, eos_id=2), 8)
    assert view("abcab") == [6, 5] and view("ba") == [4, 3] and view("zab") == [5] and view(" x") == [7]
    assert view("abzb") == [5, 4]
    assert view("") == [] and view(b"ab") == [5]
    assert view.tokens[:3] == [b"<unk>", b"<s>", b"</s>"] and view.special_token_ids == [1, 2]


def test_the_json_vocabulary_marks_special_ids_and_spells_the_rest():
    vocab = json_vocab(COMPILER.ll)
    assert vocab.special[1] and vocab.special[2] and not vocab.special[ord("{") + 3]
    assert vocab.token_bytes[ord("{") + 3] == b"{" and vocab.token_bytes[1] == b"" and vocab.token_bytes[2] == b""
    assert len(vocab.token_bytes) == VOCAB


# -- SlotGrammars ------------------------------------------------------------------------------------------
REGEX = COMPILER.compile(GrammarSpec("regex", "(ab|cd)!"))


def test_binding_a_slot_gives_its_first_token_mask_and_makes_steps_constrained():
    table = SlotGrammars(4, VOCAB)
    seen = []
    table.observe = lambda seconds, rows: seen.append((0 <= seconds < 60, rows))
    row = table.bind(2, REGEX)
    assert row.shape == (1, bitmask_words(VOCAB)) and allowed(row[0]) == {ord("a") + 3, ord("c") + 3}
    assert seen == [(True, 1)]
    active = np.array([True, True, False, False])
    assert not table.constrained(active) and table.constrained(np.array([False, False, True, False]))
    table.release(2)
    table.release(2)  # releasing a free slot is a no-op
    assert not table.constrained(np.ones(4, bool))
    with pytest.raises(GrammarError, match="Expected token"):  # a matcher that cannot start says why
        table.bind(0, Grammar("not a grammar", COMPILER.ll, GrammarSpec("lark")))


def test_each_row_of_a_step_gets_its_own_slots_mask_and_unconstrained_rows_allow_everything():
    table = SlotGrammars(4, VOCAB)
    table.bind(1, REGEX)
    masks = table.masks()
    assert masks.shape == (4, bitmask_words(VOCAB)) and (masks[[0, 2, 3]] == -1).all()
    assert allowed(masks[1]) == {ord("a") + 3, ord("c") + 3}
    table.bind(3, COMPILER.compile(GrammarSpec("choice", '["xy"]')))
    seen = []
    table.observe = lambda seconds, rows: seen.append(rows)
    assert table.advance(1, ord("c") + 3) == Advance(True, False)
    masks = table.masks()  # two constrained rows: the parallel fill
    assert allowed(masks[1]) == {ord("d") + 3} and allowed(masks[3]) == {ord("x") + 3} and seen == [2]
    assert (masks[[0, 2]] == -1).all()
    masks[1] = 0  # a copy: the next step's masks start over
    assert allowed(table.masks()[1]) == {ord("d") + 3}


def test_advancing_a_slot_follows_its_grammar_to_its_end():
    table = SlotGrammars(2, VOCAB)
    assert table.advance(0, 77) == Advance(True, False)  # an unconstrained slot takes anything
    table.bind(0, REGEX)
    assert [table.advance(0, t) for t in ids("ab!")] == [Advance(True, False)] * 2 + [Advance(True, True)]
    table.bind(1, REGEX)
    refused = table.advance(1, ord("z") + 3)
    assert (refused.ok, refused.ended, refused.cut) == (False, True, False) and refused.error


def test_a_json_object_slot_is_closed_before_its_budget_runs_out_and_says_it_was_cut():
    table = SlotGrammars(2, VOCAB)
    table.bind(0, COMPILER.compile(GrammarSpec("json_object")))
    table.bind(1, REGEX)
    for t in ids('{"a": "bc'):
        assert table.advance(0, t) == Advance(True, False)
    far = table.masks(np.array([50, 1]))
    assert ord("x") + 3 in allowed(far[0]) and allowed(far[1]) == {ord("a") + 3, ord("c") + 3}  # regex: no budget
    assert table.advance(0, ord("x") + 3) == Advance(True, False)
    near = table.masks(np.array([2, 1]))  # `"}` closes it: only a token that leaves one more to write fits
    assert allowed(near[0]) == {ord('"') + 3} and allowed(near[1]) == {ord("a") + 3, ord("c") + 3}
    step = table.advance(0, ord('"') + 3)
    assert step.ok and step.cut and not step.ended
    table.release(0)
    words = COMPILER.compile(GrammarSpec("regex", '[a-z"}]{1,20}'))  # could close the released JSON
    table.bind(0, words)  # the next request in the slot has no budget, and is not cut
    assert len(allowed(table.masks(np.array([1, 1]))[0])) == 28
    assert table.advance(0, ord("a") + 3) == Advance(True, False)
    table.release(0)
    table.bind(0, COMPILER.compile(GrammarSpec("json_object")))
    assert table.advance(0, ord("{") + 3) == Advance(True, False)  # a new request starts uncut


def test_a_resumed_slot_continues_where_its_generated_tokens_left_its_grammar():
    """A preempted request's matcher (issue 34, step 3): a fresh one fed its tokens gives the mask of
    its next token, steps on from there, refuses tokens its grammar no longer takes, and a json_object
    budget restricts the resumed mask as a step's would."""
    table = SlotGrammars(2, VOCAB)
    row = table.resume(1, REGEX, ids("c"), remaining=5)
    assert row.shape == (1, bitmask_words(VOCAB)) and allowed(row[0]) == {ord("d") + 3}
    masks = table.masks()
    assert allowed(masks[1]) == {ord("d") + 3} and (masks[0] == -1).all()
    assert table.advance(1, ord("d") + 3) == Advance(True, False)
    assert allowed(table.resume(0, REGEX, [], remaining=5)[0]) == {ord("a") + 3, ord("c") + 3}
    with pytest.raises(GrammarError, match="refused token 125"):
        table.resume(0, REGEX, ids("cz"), remaining=5)
    json_object = COMPILER.compile(GrammarSpec("json_object"))
    far = SlotGrammars(1, VOCAB).resume(0, json_object, ids('{"a": "bcx'), remaining=50)
    assert ord("x") + 3 in allowed(far[0])
    near_table = SlotGrammars(1, VOCAB)
    near = near_table.resume(0, json_object, ids('{"a": "bcx'), remaining=2)
    assert allowed(near[0]) == {ord('"') + 3}
    step = near_table.advance(0, ord('"') + 3)
    assert step.ok and step.cut and not step.ended


def test_the_llguidance_view_of_a_tokenizers_tokenizer_with_several_stop_ids():
    """Every stop id ends a grammar (EOS and, say, <|eot_id|>), and the model's padding ids are never allowed."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>", "<|eot|>"])  # 256, 257
    for tokenizer in (
        Tokenizer("hf", backend, bos_id=None, eos_id=256, extra_stop_ids=(257,)),
        Tokenizer("sentencepiece", TOKENIZER.backend, bos_id=1, eos_id=EOS, extra_stop_ids=(ord("z") + 3,)),
    ):
        ll = ll_tokenizer(tokenizer, 320)
        assert ll.vocab_size == 320
        grammar = GrammarCompiler(tokenizer, 320).compile(GrammarSpec("regex", "ab"))
        for stop in tokenizer.stop_ids:
            matcher = grammar.matcher()
            assert matcher.consume_tokens(tokenizer.encode("ab", add_bos=False)) and matcher.consume_token(stop)
            assert matcher.is_stopped(), (tokenizer.kind, stop)
        row = SlotGrammars(1, 320).bind(0, grammar)
        assert max(allowed(row[0])) < tokenizer.vocab_size
