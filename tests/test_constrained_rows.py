"""One grammar-constrained request in each slot position among unconstrained neighbours, on the tiny
random model (issue 38): sequential tests keep landing a constrained request in slot 0, so a mask filled
into the wrong row went unnoticed there."""

from __future__ import annotations

import re

import pytest
from helpers import init_params, tiny_config

from hkserve.engine.constrained import GrammarCompiler, GrammarSpec
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import PrefixCache
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.train.vocab import byte_tokenizer

SLOTS = 4
PATTERN = "(ab|cd){2,4}!"
TOKENIZER = byte_tokenizer()


@pytest.fixture(scope="module")
def runner():
    config = tiny_config(vocab_size=300)
    model = build_model(config)
    engine = Engine(model, init_params(config, 5), EngineOptions(slots=SLOTS, max_len=64, prefill_buckets=(8,)))
    runner = InferenceRunner(engine)  # driven by the test: iterate() in this thread
    runner.prefix = PrefixCache(SLOTS, "off")  # each admission takes the lowest free slot: submission order
    return runner


def _run(runner, requests):
    """Submit in order (slot i takes request i), drive the loop until idle → (token ids, finish reason)."""
    streams = [runner.submit(r) for r in requests]
    while runner.iterate():
        pass
    events = [list(s) for s in streams]
    return [[e.token.id for e in evs if e.token] for evs in events], [evs[-1].finish_reason for evs in events]


def test_one_constrained_request_in_each_slot_position_among_unconstrained_neighbours(runner):
    grammar = GrammarCompiler(TOKENIZER, 300).compile(GrammarSpec("regex", PATTERN))
    plain = [
        Request([5, 6, 7], 10, SamplingParams()),
        Request([9, 8], 10, SamplingParams(temperature=1.0, seed=3)),
        Request([11, 12, 13, 14], 10, SamplingParams(temperature=0.8, top_k=20, seed=4)),
    ]
    alone = [_run(runner, [r])[0][0] for r in plain]
    for position in range(SLOTS):
        constrained = Request(
            [5, 6, 7], 16, SamplingParams(temperature=1.0, seed=position), (TOKENIZER.eos_id,), grammar=grammar
        )
        batch = [*plain[:position], constrained, *plain[position:]]
        tokens, reasons = _run(runner, batch)
        out = tokens.pop(position)
        text = TOKENIZER.decode([t for t in out if t != TOKENIZER.eos_id])
        assert reasons[position] == "stop" and re.fullmatch(PATTERN, text), (position, text)
        assert tokens == alone, position  # the unconstrained rows, bit for bit
