"""Grammar-constrained decoding with llguidance: grammars compiled from a request's JSON schema, regex,
choice list or Lark text, one matcher per constrained request, and the per-row token bitmask the
sampling step applies (a set bit allows a token).

Why llguidance: a Rust core with no torch dependency, a JSON schema compiles in ~1 ms, and it fills a
49k-vocabulary mask in tens of microseconds (see docs/benchmarks.md). The runner owns a SlotGrammars
(slot → matcher); the engine only ever sees int32 bitmasks [B, ceil(V/32)].
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.json_budget import JsonBudget, JsonVocab

KINDS = ("json_object", "json_schema", "regex", "choice", "lark")
# JSON without free whitespace: ", " and ": " separators only, so a small model cannot wander into
# endless blank lines, and every output is what json.dumps writes by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar the library refuses: the message names the problem (HTTP 400)."""


class GrammarSpec(NamedTuple):
    """What a request asks its output to match. kind: one of KINDS; text: the schema (JSON text), the
    regex, the choices (a JSON list of strings) or the Lark grammar."""

    kind: str
    text: str = ""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def full_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """[rows, ceil(V/32)] int32 with every bit set: allows every token (an unconstrained row)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)


class _SentencePieceView:
    """What llguidance's TokenizerWrapper reads from a tokenizer that is not a `tokenizers` one (the
    SentencePiece kind): every id's bytes, its special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        size = tokenizer.vocab_size
        self.special_token_ids = [i for i in range(size) if tokenizer.backend.is_control(i)]
        special = set(self.special_token_ids)
        self.tokens = [
            tokenizer.token_text(i).encode() if i in special else tokenizer.token_bytes(i) for i in range(size)
        ] + [b""] * (vocab_size - size)
        self._ids: dict[bytes, int] = {}  # bytes -> the first plain token that spells them
        for i in range(size):
            if i not in special and self.tokens[i]:
                self._ids.setdefault(self.tokens[i], i)
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """A tokenization of exactly `text`, longest match first. Not SentencePiece's own: its
        normalizer adds a leading space and folds whitespace, and llguidance needs the exact bytes."""
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at : at + n])
                if token is not None:
                    ids.append(token)
                    at += n
                    break
            else:
                at += 1  # a byte no token spells (a model without byte fallback): left out
        return ids


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    """The llguidance view of a tokenizer over the model's whole embedding table (`vocab_size` ids; ids
    past the tokenizer's own are padding, never allowed). EOS: the tokenizer's stop ids. ~1 s: build once."""
    eos = list(tokenizer.stop_ids) or None
    if tokenizer.kind == "hf":
        return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llg.TokenizerWrapper(_SentencePieceView(tokenizer, vocab_size))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class Grammar:
    """A compiled grammar: `matcher()` starts a fresh matcher for one request. json_vocab: set for
    json_object, whose replies the runner closes before the token budget runs out (json_budget.py)."""

    def __init__(self, text: str, tokenizer: llg.LLTokenizer, spec: GrammarSpec, json_vocab: JsonVocab | None = None):
        self.text, self.tokenizer, self.spec, self.json_vocab = text, tokenizer, spec, json_vocab

    def matcher(self) -> llg.LLMatcher:
        return llg.LLMatcher(self.tokenizer, self.text, log_level=0)


def json_vocab(tokenizer: llg.LLTokenizer) -> JsonVocab:
    """Each id's bytes and whether it is special (EOS and the like), as llguidance sees them."""
    ids = range(tokenizer.vocab_size)
    special = np.asarray([tokenizer.is_special_token(i) for i in ids])
    return JsonVocab([b"" if special[i] else tokenizer.decode_bytes([i]) for i in ids], special)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (not yet validated)."""
    kind, text = spec
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return llg.grammar_from("choice", text)
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(text)
    raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")


class GrammarCompiler:
    """Compiles and validates request grammars for one tokenizer. Thread-safe (HTTP worker threads
    compile); the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll: llg.LLTokenizer | None = None
        self._json_vocab: JsonVocab | None = None
        self._lock = threading.Lock()

    @property
    def ll(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Raises GrammarError naming the problem for a grammar llguidance refuses."""
        text = grammar_text(spec)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.ll)
        if is_error:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {messages[0]}")
        if spec.kind != "json_object":
            return Grammar(text, self.ll, spec)
        with self._lock:
            if self._json_vocab is None:
                self._json_vocab = json_vocab(self._ll)
        return Grammar(text, self.ll, spec, self._json_vocab)


class Advance(NamedTuple):
    ok: bool  # the token was allowed
    ended: bool  # the grammar can take nothing more: the request is complete
    error: str = ""
    cut: bool = False  # the budget closed the output early (json_budget.py): it ends with "length"


class SlotGrammars:
    """The runner's table of constrained slots (slot → matcher), and the bitmasks of a step.

    Only the runner's loop thread calls it. `observe` (if set) receives each mask fill's seconds and
    rows (constrained slots filled)."""

    def __init__(self, slots: int, vocab_size: int):
        self.slots, self.vocab_size = slots, vocab_size
        self._matchers: dict[int, llg.LLMatcher] = {}
        self._budgets: dict[int, JsonBudget] = {}  # json_object slots: closed before the budget ends
        self._cut: set[int] = set()  # slots whose output a budget restricted
        self._bitmask = full_bitmask(slots, vocab_size)  # [B, W] reused each step
        self._executor: llg.LLExecutor | None = None
        self.observe: Callable[[float, int], None] | None = None

    def bind(self, slot: int, grammar: Grammar) -> np.ndarray:
        """Start the slot's matcher → the bitmask [1, W] of its first token (sampled by the prefill)."""
        matcher = grammar.matcher()
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self._matchers[slot] = matcher
        if grammar.json_vocab is not None:
            self._budgets[slot] = JsonBudget(grammar.json_vocab)
        row = full_bitmask(1, self.vocab_size)
        started = time.perf_counter()
        fill_next_token_bitmask(matcher, row, 0)
        self._timed(started, 1)
        return row

    def resume(self, slot: int, grammar: Grammar, generated: list[int], remaining: int) -> np.ndarray:
        """A preempted request's matcher again: a fresh one fed the tokens it had generated → the bitmask
        [1, W] of its next token (sampled by the resuming prefill), restricted by its JSON budget as
        `masks` would with `remaining` tokens left."""
        self.bind(slot, grammar)
        for token_id in generated:
            if not self.advance(slot, token_id).ok:  # it took them before: the same grammar must again
                raise GrammarError(f"the grammar refused token {token_id} it allowed before preemption")
        row = full_bitmask(1, self.vocab_size)
        fill_next_token_bitmask(self._matchers[slot], row, 0)
        if slot in self._budgets and self._budgets[slot].restrict(row[0], remaining):
            self._cut.add(slot)
        return row

    def release(self, slot: int) -> None:
        self._matchers.pop(slot, None)
        self._budgets.pop(slot, None)
        self._cut.discard(slot)

    def constrained(self, active: np.ndarray) -> bool:
        """Whether any active slot [B] bool has a matcher (only then does a step need masks)."""
        return any(active[slot] for slot in self._matchers)

    def advance(self, slot: int, token_id: int) -> Advance:
        matcher = self._matchers.get(slot)
        if matcher is None:
            return Advance(True, False)
        if not matcher.consume_token(token_id):
            return Advance(False, True, matcher.get_error())
        if slot in self._budgets:
            self._budgets[slot].feed(token_id)
        return Advance(True, matcher.is_stopped(), cut=slot in self._cut)

    def masks(self, remaining: np.ndarray | None = None) -> np.ndarray:
        """Bitmasks [B, W] of the next token: constrained slots' from their matchers, others all set.
        remaining [B]: tokens each slot may still emit, this one included (max_tokens, context); near
        its end a json_object slot keeps only the tokens that leave room to close its JSON."""
        started = time.perf_counter()
        self._bitmask[:] = -1
        pairs = list(self._matchers.items())
        if len(pairs) == 1:
            fill_next_token_bitmask(pairs[0][1], self._bitmask, pairs[0][0])
        elif pairs:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            fill_next_token_bitmask_par(self._executor, [(m, slot) for slot, m in pairs], self._bitmask)
        if remaining is not None:
            for slot, budget in self._budgets.items():
                if budget.restrict(self._bitmask[slot], int(remaining[slot])):
                    self._cut.add(slot)
        self._timed(started, len(pairs))
        return self._bitmask.copy()

    def _timed(self, started: float, rows: int) -> None:
        if self.observe is not None:
            self.observe(time.perf_counter() - started, rows)
