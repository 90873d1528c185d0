"""Programs compiled around ready (engine/background_compile.py, programs.py): lazy serving gives eager's
tokens with fewer programs before ready, a background-compiled program is used without another compile,
and the program table compiles each key once, whoever asks. The background thread's progress is driven
by the test (`run_pending` inline); the table's race by events the test holds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers import init_params, tiny_config

from hkserve.api.app import create_app
from hkserve.engine.background_compile import Compiles
from hkserve.engine.constrained import GrammarCompiler, GrammarSpec
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.programs import ProgramTable
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.train.vocab import byte_tokenizer

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 5)
OPTIONS = EngineOptions(slots=2, max_len=256, prefill_buckets=(8, 32))  # windows 128, 256
CUT = 128  # common: contexts up to 128 tokens; rare: the 256 window's step and long prompts' chunks
SCORING = [(8, 0), (32, 0), (32, 128), (32, 256)]  # a scoring prefill's (bucket, window): one-shot chunks
LONG = np.random.default_rng(2).integers(0, 96, 200).tolist()  # 7 chunks, reaching the 256 window


def served(engine: Engine, request: Request) -> list[int]:
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        return [t.id for t in runner.generate(request)]
    finally:
        runner.stop()


def long_request() -> Request:
    return Request(LONG, 40, SamplingParams(temperature=0.8, seed=7))  # decodes past 128 and 200 + 40 < 256


def test_lazy_gives_eagers_tokens_for_a_long_prompt_with_fewer_programs_before_ready(compiles):
    eager = Engine(MODEL, PARAMS, OPTIONS)
    Compiles(eager, "eager").before_ready()
    eager_before_ready = len(compiles)
    lazy = Engine(MODEL, PARAMS, OPTIONS)
    compiles.clear()
    Compiles(lazy, "lazy", upto=CUT).before_ready()
    lazy_before_ready = len(compiles)
    rare = lazy.rare_calls(CUT)
    long = [c for c in rare if c.common]
    assert {c.context for c in long} == {256} and len(long) == 2  # the 256 window's step and continuation chunk
    assert lazy.scoring_chunks() == SCORING and len(rare) == len(long) + len(SCORING)  # scoring: any context
    assert len(lazy.programs) == len(eager.programs) - len(rare)
    assert 0 < lazy_before_ready <= eager_before_ready - len(rare)
    assert served(lazy, long_request()) == served(eager, long_request())
    left = lazy.rare_calls(CUT)  # the request compiled its own on the spot; no scoring program
    assert len(left) == len(SCORING) and not any(c.common for c in left)


def test_a_background_compiled_program_is_used_without_another_compile(compiles):
    """/health reports the programs compiled and pending as the background compiles go."""
    engine = Engine(MODEL, PARAMS, OPTIONS)
    background = Compiles(engine, "background", upto=CUT)
    background.before_ready()
    app = create_app(InferenceRunner(engine), byte_tokenizer(), "tiny", engine.max_len)
    app.state.compiles = background.status  # as hkserve serve sets it
    app.state.context.runner.ready.set()
    client = TestClient(app)

    def health() -> dict:
        """/health's programs: mode, compiled, pending; the table's counts checked here (no bound: all loaded)."""
        body = client.get("/health").json()
        programs = body["programs"]
        table = {"loaded": programs["compiled"], "max_loaded": None, "evictions": 0, "reloads": 0, "reload_misses": 0}
        assert {k: programs.pop(k) for k in table} == table
        return body

    before_ready = len(engine.programs)
    assert health()["status"] == "ok"
    rare = 2 + len(SCORING)  # the 256 window's step and continuation chunk, and scoring
    assert health()["programs"] == {"mode": "background", "compiled": before_ready, "pending": rare}
    compiles.clear()
    background.run_pending(limit=1)  # the background thread's progress, one program at a time
    assert health()["programs"] == {"mode": "background", "compiled": before_ready + 1, "pending": rare - 1}
    assert not background.finished.is_set()
    background.run_pending()
    assert health()["programs"] == {"mode": "background", "compiled": before_ready + rare, "pending": 0}
    assert len(compiles) == rare and background.finished.is_set()
    assert background.status()["pending"] == 0 and engine.rare_calls(CUT) == []
    compiles.clear()
    assert len(served(engine, long_request())) == 40
    assert compiles == []  # the runner called the executables the background compiled


def test_a_key_compiles_once_and_whoever_asks_meanwhile_waits_for_it():
    table, started, release = ProgramTable(), threading.Event(), threading.Event()
    builds, results = [], {}

    def build():
        builds.append(1)
        started.set()
        release.wait()
        return object()

    first = threading.Thread(target=lambda: results.setdefault("first", table.get(("k",), build)))
    first.start()
    started.wait()  # the first asker holds the key, compiling
    second = threading.Thread(target=lambda: results.setdefault("second", table.get(("k",), build)))
    second.start()
    assert not table.has(("k",))
    release.set()
    first.join()
    second.join()
    assert len(builds) == 1 and results["first"] is results["second"] and table.has(("k",))
    assert table.get(("k",), build) is results["first"] and len(builds) == 1


def test_a_failed_compile_reaches_its_waiters_and_the_next_asker_compiles_again():
    table = ProgramTable()

    def broken():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        table.get(("k",), broken)
    made = object()
    assert table.get(("k",), lambda: made) is made and len(table) == 1


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(ValueError, match="eager, background, lazy"):
        Compiles(Engine(MODEL, PARAMS, EngineOptions(slots=1, max_len=64)), "sometimes")


def test_stop_returns_only_once_the_compile_under_way_has_finished():
    """serve's shutdown calls stop() and returns: the interpreter must not finalize beneath a daemon
    thread still inside XLA's compiler (that process died by SIGABRT). The fake compile goes on only
    after stop() was called and then waits for the caller (2 s at most): a stop() that does not wait
    lets the caller record "stopped" first."""
    background = Compiles(Engine(MODEL, PARAMS, EngineOptions(slots=1, max_len=64)), "background")
    started, caller_went_on, order = threading.Event(), threading.Event(), []

    class SlowCall:
        context = 1

        def compile(self):
            started.set()
            background._stop.wait()
            caller_went_on.wait(2)
            order.append("compiled")

    background._pending = [SlowCall()]
    background.start()
    started.wait()
    background.stop()
    order.append("stopped")
    caller_went_on.set()
    background._thread.join()
    assert order == ["compiled", "stopped"]


# -- every kind of request after the background compiles -------------------------------------------
GRAMMAR_CONFIG = tiny_config(vocab_size=300)  # the byte tokenizer's grammar needs its 256 bytes
SERVED = EngineOptions(slots=2, max_len=256, prefill_buckets=(8, 32), structured=True, prefix_cache="on")
SERVED_CUT = 32  # rare: the 128 and 256 windows' programs (steps, constrained steps, copies, chunks), scoring
TURN = np.random.default_rng(3).integers(0, 96, 40).tolist()  # two chunks, the second at the 128 window
SEEN = list(range(200))  # most tokens seen: a continuation soon finds its last token in it (drafts)


def compiled_in_background(engine) -> tuple[InferenceRunner, int]:
    """A runner over `engine` (made first: its token budget picks the chunk sizes the inventory holds)
    once the background compiles are all done, and how many there were; the test drives its loop."""
    runner = InferenceRunner(engine)
    background = Compiles(engine, "background", upto=SERVED_CUT)
    background.before_ready()
    pending = background.status()["pending"]
    background.run_pending()
    assert background.finished.is_set()
    return runner, pending


def run(runner: InferenceRunner, *requests: Request) -> list[list]:
    """Submit the requests, drive the loop until idle → each one's events (every one finished)."""
    streams = [runner.submit(r) for r in requests]
    while runner.iterate():
        pass
    events = [list(s) for s in streams]
    assert all(e[-1].finish_reason in ("stop", "length") for e in events), events
    return events


def test_after_the_background_compiles_no_kind_of_request_compiles_anything(compiles):
    """Plain, scored (echo / prompt logprobs), grammar-constrained and a prefix-cached second turn on a
    structured prefix-caching paged engine; then, the same engine speculating, a drafting request."""
    model = build_model(GRAMMAR_CONFIG)
    engine = Engine(model, init_params(GRAMMAR_CONFIG, 5), SERVED)
    runner, pending = compiled_in_background(engine)
    assert pending > len(SCORING)  # the cut left the windows' programs and scoring for after ready
    grammar = GrammarCompiler(byte_tokenizer(), 300).compile(GrammarSpec("regex", "(ab|cd){2,4}!"))
    compiles.clear()
    reply = [e.token.id for e in run(runner, Request(TURN, 6))[0] if e.token]
    second = Request(TURN + reply + [7, 8, 9], 4)
    streams = [runner.submit(second), runner.submit(Request([5, 6, 7], 4))]
    scored = run(runner, Request(TURN, 3, logprobs=2, prompt_logprobs=2))[0]
    assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 2 and streams[0].cached_tokens > 0
    assert len(scored[0].prompt) == len(TURN) - 1  # every prompt token after the first scored
    run(runner, Request([5, 6, 7], 12, SamplingParams(temperature=1.0, seed=1), grammar=grammar))
    assert compiles == []

    spec = SpeculativeEngine(engine, SpecConfig(k=4, min_tokens=0.0))
    runner, pending = compiled_in_background(spec)  # its own programs: the engine's are all compiled
    assert pending == 1  # the 256 window's verify step
    compiles.clear()
    run(runner, Request(SEEN, 30), Request(TURN, 2, prompt_logprobs=1))  # verify steps at the 256 window
    assert compiles == []
    assert spec.counts.verify_rows > 0  # it drafted
