"""Grammar-constrained decoding without a model: the device-side bitmask, the llguidance view of both
tokenizer kinds, the tool-call parser, and the runner's split step on the tiny random model."""

from __future__ import annotations

import io
import json
import random
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import sentencepiece as spm
from helpers import init_params, tiny_config
from llguidance.numpy import fill_next_token_bitmask

from hkserve.api.tools import ToolCallParser, parse_tools
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.constrained import GrammarCompiler, GrammarSpec, full_bitmask
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams, apply_bitmask, make_settings, sample
from hkserve.train.vocab import byte_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["kind", "ok", "n"],
    "additionalProperties": False,
}


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little").reshape(bitmask.shape[0], -1)[:, :vocab] == 1


def test_bitmask_bans_tokens_before_sampling_even_with_top_k_and_penalties():
    rng = np.random.default_rng(0)
    vocab, rows = 77, 4
    bits = rng.integers(-(2**31), 2**31, (rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bits[:, 0] |= 1  # at least one allowed token per row
    allowed = _allowed(bits, vocab)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 5)
    masked = np.asarray(apply_bitmask(logits, jnp.asarray(bits)))
    assert np.array_equal(np.isfinite(masked), allowed)
    assert np.array_equal(masked[allowed], np.asarray(logits)[allowed])
    settings = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3, seed=1),
        SamplingParams(temperature=2.0, top_p=0.9, min_p=0.05, seed=2),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=1.0, logit_bias={5: 100.0}),
    ]
    draw = jax.jit(sample, static_argnums=3)
    for position in range(8):
        out = draw(logits, make_settings(settings, vocab), jnp.full((rows,), position), 0, None, jnp.asarray(bits))
        tokens = np.asarray(out.token)
        assert allowed[np.arange(rows), tokens].all(), (position, tokens)
    greedy = draw(logits, make_settings([SamplingParams()] * rows, vocab), jnp.zeros(rows), 0, None, jnp.asarray(bits))
    assert np.array_equal(np.asarray(greedy.token), np.where(allowed, np.asarray(logits), -np.inf).argmax(-1))
    # all bits set: exactly the unmasked sample
    full = full_bitmask(rows, vocab)
    out_full = draw(logits, make_settings(settings, vocab), jnp.zeros(rows), 0, None, jnp.asarray(full))
    out_none = draw(logits, make_settings(settings, vocab), jnp.zeros(rows), 0, None, None)
    assert np.array_equal(np.asarray(out_full.token), np.asarray(out_none.token))


def _trained_sentencepiece() -> Tokenizer:
    text = ['{"kind": "cat", "ok": true}', '{"kind": "dog", "ok": false, "n": 22}', "the quick brown fox"] * 30
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return Tokenizer("sentencepiece", sp, bos_id=sp.bos_id(), eos_id=sp.eos_id())


@pytest.mark.parametrize("make", [byte_tokenizer, _trained_sentencepiece, "smollm2"])
def test_random_walks_through_the_mask_give_valid_json_for_each_tokenizer_kind(make, request):
    """Any path the masks allow (tokens drawn at random among them) ends in a valid document: the
    llguidance view of the tokenizer's bytes (SentencePiece ▁ and <0xNN>, gpt2 byte-level) is right."""
    tokenizer = request.getfixturevalue("smollm2")[2] if make == "smollm2" else make()
    padded = tokenizer.vocab_size + 40  # the model's table is larger: padding ids are never allowed
    grammar = GrammarCompiler(tokenizer, padded).compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rng = random.Random(0)
    for _ in range(5):
        matcher, ids, mask = grammar.matcher(), [], full_bitmask(1, padded)
        while not matcher.is_stopped():
            fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(_allowed(mask, padded)[0])
            assert allowed.max() < tokenizer.vocab_size
            token = int(rng.choice(allowed))
            assert matcher.consume_token(token)
            ids.append(token)
            assert len(ids) < 200
        text = tokenizer.decode([i for i in ids if i not in tokenizer.stop_ids])
        jsonschema.validate(json.loads(text), SCHEMA)


TOOLS = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto", True)


def test_tool_call_parser_gives_the_same_calls_however_the_text_is_split():
    text = (
        'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": {"b": "}"}, "c": [1]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    whole = ToolCallParser()
    content, _ = whole.feed(text, final=True)
    assert content.strip() == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == [
        ("f", '{"a": {"b": "}"}, "c": [1]}'),
        ("g", "{}"),
    ]
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser, streamed_content, calls = ToolCallParser(), "", {}
        for k, part in enumerate(parts):
            piece, deltas = parser.feed(part, final=k == len(parts) - 1)
            streamed_content += piece
            for d in deltas:
                if d.id is not None:
                    calls[d.index] = [d.name, ""]
                calls[d.index][1] += d.arguments
        assert streamed_content == content
        assert [tuple(v) for v in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.calls
        ]


@pytest.fixture(scope="module", params=[True, False], ids=["split", "fused"])
def tiny_runner(request):
    """Both ways of running a constrained step: split (the model half dispatched before the masks are
    filled; the GPU default) and fused (one program once the masks are known; the CPU default)."""
    config = tiny_config(vocab_size=300)
    model = build_model(config)
    params = init_params(config, 3)
    engine = Engine(model, params, EngineOptions(slots=4, max_len=64, prefill_buckets=(8,), split_masks=request.param))
    runner = InferenceRunner(engine)  # driven by the test: iterate() in this thread
    yield runner


def _run(runner, requests):
    """Submit, drive the loop in this thread until idle → (token ids, finish reason) per request."""
    streams = [runner.submit(r) for r in requests]
    while runner.iterate():
        pass
    events = [list(s) for s in streams]  # all queued already: iteration ends at each final event
    return [[e.token.id for e in evs if e.token] for evs in events], [evs[-1].finish_reason for evs in events]


def test_runner_split_step_keeps_unconstrained_rows_bit_identical(tiny_runner):
    """The tiny model with SmolLM2-free bytes: a regex-constrained row beside unconstrained ones (greedy
    and seeded) leaves their tokens exactly as alone, and itself ends ("stop") when the grammar does."""
    tokenizer = byte_tokenizer()
    grammar = GrammarCompiler(tokenizer, 300).compile(GrammarSpec("regex", "(ab|cd){2,3}"))
    plain = [
        Request([5, 6, 7], 12, SamplingParams()),
        Request([9, 8], 12, SamplingParams(temperature=1.0, seed=3)),
    ]
    alone, _ = _run(tiny_runner, plain)
    constrained = Request([5, 6, 7], 12, SamplingParams(temperature=1.0, seed=1), (tokenizer.eos_id,), grammar=grammar)
    mixed, reasons = _run(tiny_runner, [constrained, *plain])
    assert mixed[1:] == alone
    text = tokenizer.decode([t for t in mixed[0] if t != tokenizer.eos_id])
    assert reasons[0] == "stop" and re.fullmatch("(ab|cd){2,3}", text), text
