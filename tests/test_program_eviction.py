"""A bound on the loaded executables (engine/programs.py, `serve --max-loaded-programs`): past it the
least recently called program is dropped and loaded again from JAX's persistent compile cache when next
called. Checked on a tiny model: with one or two programs loaded at a time, the replies (tokens,
logprobs, scored prompts) are those of an engine that keeps all of them, every program run after the
warm-up comes from the cache (JAX's own events: a compile without a cache hit fails it), nothing keeps
an evicted executable alive, and the eviction order is least recently called, programs compiled ahead
of time first. The loop is driven by the test (`runner.iterate`): no threads, no timing."""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.cli import serve
from hkserve.cli.main import build_parser
from hkserve.engine import programs as programs_module
from hkserve.engine.background_compile import Compiles
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.programs import ProgramTable
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 5)  # the eager init's values, one jitted compile per process
OPTIONS = EngineOptions(slots=2, max_len=256, prefill_buckets=(8, 32))  # windows 128, 256
LONG = np.random.default_rng(2).integers(0, 96, 200).tolist()  # 7 chunks, reaching the 256 window
TURN = np.random.default_rng(3).integers(0, 96, 40).tolist()
COMPILE = "/jax/core/compile/backend_compile_duration"  # every program compiled or loaded from the cache
CACHE_HITS = "/jax/compilation_cache/cache_hits"


def requests() -> list[Request]:
    """Seeded sampling over the 256 window, greedy with logprobs, a scored prompt: many programs."""
    return [
        Request(LONG, 40, SamplingParams(temperature=0.8, seed=7)),
        Request(list(range(1, 20)), 12, SamplingParams(temperature=0.0), logprobs=2),
        Request(TURN, 3, logprobs=2, prompt_logprobs=2),
    ]


def replies(engine: Engine) -> list[list]:
    """Each request's tokens (ids, logprobs, alternatives) and scored prompt, its requests one after
    the other (each alone in the batch, so the programs alternate: prefill, chunks, steps, scoring)."""
    runner, out = InferenceRunner(engine), []
    for request in requests():
        stream = runner.submit(request)
        while runner.iterate():
            pass
        events = list(stream)
        assert events[-1].finish_reason in ("stop", "length"), events
        out.append([(e.token, e.prompt) for e in events if e.token or e.prompt])
    return out


@pytest.fixture
def programs_run() -> dict[str, int]:
    """JAX's compile events while the test runs: programs compiled or loaded, and those loaded from the cache."""
    seen = {"programs": 0, "hits": 0}

    def on_span(event, _secs, **_):
        seen["programs"] += event == COMPILE

    def on_event(event, **_):
        seen["hits"] += event == CACHE_HITS

    jax.monitoring.register_event_duration_secs_listener(on_span)
    jax.monitoring.register_event_listener(on_event)
    yield seen
    jax.monitoring.unregister_event_duration_listener(on_span)
    jax.monitoring.unregister_event_listener(on_event)


def compiled(max_loaded: int | None) -> Engine:
    """An engine with every program compiled (those its first copy compiled: from the cache), bounded."""
    engine = Engine(MODEL, PARAMS, OPTIONS)
    Compiles(engine, "eager").before_ready()
    engine.programs.bound(max_loaded)
    return engine


@pytest.mark.parametrize("max_loaded", [1, 2])
def test_evicted_programs_reload_from_the_cache_and_give_the_same_replies(max_loaded, programs_run):
    expected = replies(compiled(None))
    engine = compiled(max_loaded)
    assert engine.programs.loaded() == max_loaded and engine.programs.evictions == len(engine.programs) - max_loaded
    programs_run.update(programs=0, hits=0)
    assert replies(engine) == expected
    status = engine.programs.status()
    assert status["loaded"] <= max_loaded and status["max_loaded"] == max_loaded
    assert status["reloads"] >= 6, status  # prefill, chunks, the two windows' steps, scoring: each back
    # Every program run after the warm-up was a reload, and each came from the persistent cache.
    assert status["reload_misses"] == 0
    assert programs_run == {"programs": status["reloads"], "hits": status["reloads"]}


def test_nothing_keeps_an_evicted_executable(programs_run):
    engine = compiled(None)
    held = [weakref.ref(entry.executable) for entry in engine.programs._done.values()]
    replies(engine)  # every program in the runner's hands once (Program's own per-signature entries)
    engine.programs.bound(1)
    gc.collect()
    assert sum(ref() is not None for ref in held) == 1


def fake(name: str):
    """A build that makes a stand-in executable (no JAX: its reloads meet no cache hit)."""
    return lambda: f"executable {name}"


def test_least_recently_called_goes_first_and_ahead_of_time_compiles_before_any_called(monkeypatch):
    monkeypatch.setattr(programs_module, "persistent_cache_on", lambda: True)
    table = ProgramTable()
    table.bound(2)
    table.get(("a",), fake("a"))  # called
    table.get(("b",), fake("b"))  # called, later
    table.get(("c",), fake("c"), ahead=True)  # compiled ahead: evicted before a called one
    assert table.loaded() == 2 and [k for k, e in table._done.items() if e.executable] == [("a",), ("b",)]
    table.get(("a",), fake("a"))  # a called again: b is now the least recently called
    table.get(("d",), fake("d"))
    assert [k for k, e in table._done.items() if e.executable] == [("a",), ("d",)]
    assert table.evictions == 2 and table.reloads == 0 and len(table) == 4 and table.has(("c",))
    table.get(("b",), fake("b"))  # back: a reload, and this stand-in's compile met no cache hit
    assert table.reloads == 1 and table.reload_misses == 1


def test_a_bound_is_refused_without_the_persistent_cache(monkeypatch):
    monkeypatch.setattr(programs_module, "persistent_cache_on", lambda: False)
    with pytest.raises(ValueError, match="persistent compile cache"):
        ProgramTable().bound(4)
    with pytest.raises(ValueError, match="at least one"):
        ProgramTable().bound(0)
    ProgramTable().bound(None)  # no bound needs no cache


def test_serve_bounds_the_programs_only_with_the_compile_cache_and_one_host(monkeypatch):
    def bounded(max_loaded: int, multi_host: bool = False) -> int | None:
        engine = Engine(MODEL, PARAMS, OPTIONS)
        serve.bound_programs(engine, max_loaded, multi_host)
        return engine.programs.max_loaded

    assert bounded(4) == 4 and bounded(0) is None and bounded(4, multi_host=True) is None
    monkeypatch.setattr(serve, "persistent_cache_on", lambda: False)
    assert bounded(4) is None  # HKSERVE_COMPILE_CACHE=off: every program stays loaded
    assert build_parser().parse_args(["serve"]).max_loaded_programs == serve.MAX_LOADED_PROGRAMS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-loaded-programs", "-1"])
