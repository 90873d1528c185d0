"""A json_object reply cut by its token budget still parses (hkserve/engine/json_budget.py): the tracker's
closing text against json.loads and llguidance, and the runner on the tiny random model, whose bytes at
temperature 1.0 wander into long strings and deep nesting."""

from __future__ import annotations

import json
import random

import llguidance as llg
import pytest
from helpers import init_params, tiny_config

from hkserve.engine.constrained import JSON_OPTIONS, GrammarCompiler, GrammarSpec
from hkserve.engine.engine import Engine
from hkserve.engine.json_budget import LOST, State, closing, feed, growth_bound, need
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.train.vocab import byte_tokenizer


def _random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth < 3 and pick < 0.3:
        return {"".join(rng.choice('ab"\\\u00e9') for _ in range(rng.randint(0, 3))): _random_value(rng, depth + 1)}
    if depth < 3 and pick < 0.5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([0, -1.5e-3, 12, 3.25, True, False, None, 'q"\\u\n\u0001z', "", "\u2603"])


def _prefixes():
    rng = random.Random(0)
    for _ in range(60):
        obj = {f"k{i}": _random_value(rng) for i in range(rng.randint(0, 3))}
        text = json.dumps(obj, ensure_ascii=False).encode()  # llguidance escapes only control characters
        for i in range(len(text) + 1):
            yield text, text[:i]


def test_every_prefix_of_a_json_object_closes_into_json_that_llguidance_accepts():
    tokenizer = byte_tokenizer()
    ll = GrammarCompiler(tokenizer, 300).ll
    grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    checked = 0
    for text, prefix in _prefixes():
        state = feed(State(), prefix)
        assert state is not LOST, prefix
        try:
            prefix.decode()
        except UnicodeDecodeError:  # a prefix ending inside a character: the rest of it counts in the need
            assert need(state) > len(closing(state)), prefix
            continue
        closed = prefix + closing(state).encode()
        assert need(state) == len(closing(state)) and isinstance(json.loads(closed), dict), closed
        assert (closing(state) == "") == (prefix == text), prefix  # complete at the end only
        if checked % 7 == 0:  # and llguidance on a sample: the closing is what the grammar allows
            matcher = llg.LLMatcher(ll, grammar, log_level=0)
            assert matcher.consume_tokens(ll.tokenize_bytes(closed)), closed
            assert matcher.is_accepting(), closed
        checked += 1
    assert checked > 1000


def test_the_tracker_loses_text_the_grammar_would_refuse():
    for text in (b'{"a" : 1}', b'{"a": 1}x', b'{"a": 1.}', b'{"a": tru}', b'{"a":1}', b'{"a": "\\uzz"}'):
        assert feed(State(), text) is LOST, text


@pytest.fixture(scope="module")
def tiny_runner():
    config = tiny_config(vocab_size=300)
    engine = Engine(
        build_model(config), init_params(config, 5), EngineOptions(slots=4, max_len=64, prefill_buckets=(8,))
    )
    return InferenceRunner(engine)  # driven by the test: iterate() in this thread


def test_json_object_replies_parse_at_any_max_tokens_and_say_length_when_cut(tiny_runner):
    tokenizer = byte_tokenizer()
    grammar = GrammarCompiler(tokenizer, 300).compile(GrammarSpec("json_object"))
    requests = [
        Request([5, 6, 7], max_tokens, SamplingParams(temperature=1.0, seed=seed), (tokenizer.eos_id,), grammar=grammar)
        for seed, max_tokens in enumerate([4, 6, 9, 13, 17, 24, 31, 40, 50, 58, 8, 11])
    ]
    streams = [tiny_runner.submit(r) for r in requests]
    while tiny_runner.iterate():
        pass
    reasons = []
    for request, stream in zip(requests, streams):
        events = list(stream)
        ids = [e.token.id for e in events if e.token and e.token.id != tokenizer.eos_id]
        text = tokenizer.decode(ids)
        assert isinstance(json.loads(text), dict), (request.max_tokens, text)
        assert len(ids) <= request.max_tokens
        reasons.append(events[-1].finish_reason)
    assert set(reasons) <= {"stop", "length"} and "length" in reasons, reasons


def test_no_token_adds_more_to_the_closing_than_its_growth_bound():
    pieces = [bytes([b]) for b in range(256)] + [
        b'", "',
        b'": [',
        b"false",
        b" true",
        b"[f",
        b"[n",
        b", t",
        b"\\u00",
        b"\\u",
        b'"}',
        b"}, {",
        b"1.5e",
        b"-0.",
        "é".encode(),
        "☃".encode()[:2],
        b'": "',
        b'", "a": [{"',
        b"[[[[",
        b"{{",
        b", ",
        b"e+",
        b",,,,",
        b'""",',
        b' ","',
    ]
    states = {feed(State(), prefix) for _, prefix in _prefixes()}
    for state in states:
        before = need(state)
        for piece in pieces:
            after = feed(state, piece)
            assert after is LOST or need(after) - before <= growth_bound(piece), (state, piece)
