"""Programs compiled around ready (engine/background_compile.py, programs.py): lazy serving gives eager's
tokens with fewer programs before ready, a background-compiled program is used without another compile,
and the program table compiles each key once, whoever asks. The background thread's progress is driven
by the test (`run_pending` inline); the table's race by events the test holds."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers import tiny_config

from hkserve.api.app import create_app
from hkserve.engine.background_compile import Compiles
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.programs import ProgramTable
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.train.vocab import byte_tokenizer

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = MODEL.init(jax.random.PRNGKey(5))
OPTIONS = EngineOptions(slots=2, max_len=256, prefill_buckets=(8, 32))  # windows 128, 256
CUT = 128  # common: contexts up to 128 tokens; rare: the 256 window's step and long prompts' chunks
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
    assert {c.context for c in rare} == {256} and len(rare) == 2  # the 256 window's step and continuation chunk
    assert len(lazy.programs) == len(eager.programs) - len(rare)
    assert 0 < lazy_before_ready <= eager_before_ready - len(rare)
    assert served(lazy, long_request()) == served(eager, long_request())
    assert lazy.rare_calls(CUT) == []  # the request compiled them on the spot


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
        return client.get("/health").json()

    before_ready = len(engine.programs)
    assert health()["status"] == "ok"
    assert health()["programs"] == {"mode": "background", "compiled": before_ready, "pending": 2}
    compiles.clear()
    background.run_pending(limit=1)  # the background thread's progress, one program at a time
    assert health()["programs"] == {"mode": "background", "compiled": before_ready + 1, "pending": 1}
    assert not background.finished.is_set()
    background.run_pending()
    assert health()["programs"] == {"mode": "background", "compiled": before_ready + 2, "pending": 0}
    assert len(compiles) == 2 and background.finished.is_set()
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
