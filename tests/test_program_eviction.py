"""A bound on the loaded executables (engine/programs.py, `serve --max-loaded-programs`): past it the
least recently called program is dropped, and deserialized from its entry in JAX's persistent cache
(found by the key JAX computed at its first load: cache_entries.py) when next called. Checked on a
tiny model: with one or two programs loaded at a time, the replies (tokens, logprobs, scored prompts)
are those of an engine that keeps all of them, no program run after the warm-up was traced, compiled
or even looked up in the persistent cache (JAX's own events), nothing keeps an evicted executable
alive, the eviction order is least recently called, programs compiled ahead of time first, and an
entry the cache dropped is compiled again and counted. The loop is driven by the test
(`runner.iterate`): no threads, no timing."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

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
TRACE = "/jax/core/compile/jaxpr_trace_duration"  # every function traced (lowered next)
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
    """JAX's events while the test runs: functions traced, programs compiled or loaded from the
    persistent cache, and those loaded from it."""
    seen = {"traces": 0, "programs": 0, "hits": 0}

    def on_span(event, _secs, **_):
        seen["programs"] += event == COMPILE
        seen["traces"] += event == TRACE

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
def test_evicted_programs_are_deserialized_and_give_the_same_replies(max_loaded, programs_run):
    expected = replies(compiled(None))
    engine = compiled(max_loaded)
    assert engine.programs.loaded() == max_loaded and engine.programs.evictions == len(engine.programs) - max_loaded
    programs_run.update(traces=0, programs=0, hits=0)
    assert replies(engine) == expected
    status = engine.programs.status()
    assert status["loaded"] <= max_loaded and status["max_loaded"] == max_loaded
    assert status["reloads"] >= 6, status  # prefill, chunks, the two windows' steps, scoring: each back
    # Every program run after the warm-up was a reload: deserialized, not traced, compiled or loaded
    # from the persistent cache (that is JAX's compile event, hit or miss).
    assert status["reload_misses"] == 0
    assert programs_run == {"traces": 0, "programs": 0, "hits": 0}


def test_nothing_keeps_an_evicted_executable(programs_run):
    engine = compiled(None)
    held = [weakref.ref(entry.executable) for entry in engine.programs._done.values()]
    # XLA's executables (no weakrefs): held here, so each counts one reference more than its holders'.
    xla = [entry.executable._executable.xla_executable for entry in engine.programs._done.values()]
    replies(engine)  # every program in the runner's hands once (Program's own per-signature entries)
    engine.programs.bound(1)
    gc.collect()
    assert sum(ref() is not None for ref in held) == 1
    # Nor what a reload keeps of each (its cache entry: shardings, pytrees, not the executable).
    assert sum(sys.getrefcount(x) > 3 for x in xla) == 1  # 3: the list, `x`, getrefcount's argument


def entry_file(entry) -> Path:
    """The file of a program's entry in JAX's persistent cache (this test run's own: conftest.py)."""
    return Path(jax.config.jax_compilation_cache_dir) / f"{entry.cache_entry.cache_key}-cache"


@pytest.mark.slow  # the default suite: test_a_program_whose_entry_is_gone_is_loaded_again_and_counted
def test_a_reload_whose_cache_entry_is_gone_loads_it_as_the_first_time(programs_run):
    expected = replies(compiled(None))
    engine = compiled(2)
    evicted = [e for e in engine.programs._done.values() if e.executable is None]
    files = {entry_file(e): entry_file(e).read_bytes() for e in evicted}
    for path in files:
        path.unlink()  # the bounded cache dropped them
    programs_run.update(traces=0, programs=0, hits=0)
    try:
        assert replies(engine) == expected
    finally:
        for path, data in files.items():  # those not compiled again here, for the run's other tests
            if not path.exists():
                path.write_bytes(data)
    # Each program whose entry was gone compiled again at its first reload (a miss, no cache hit) and
    # wrote its entry again: its later reloads deserialized it, nothing compiled.
    status = engine.programs.status()
    assert 6 <= status["reload_misses"] < status["reloads"], status
    assert programs_run["programs"] == status["reload_misses"] and programs_run["hits"] == 0


def fake(name: str):
    """A build that makes a stand-in executable (no JAX)."""
    return lambda: f"executable {name}"


class FakeCache:
    """Stand-in cache entries (programs.cache_entries): an executable is its own entry; those in
    `gone` were dropped from the cache; with `lookups` False a build looked nothing up."""

    def __init__(self):
        self.gone, self.lookups = set(), True

    def start_noting(self):
        pass

    def noted(self):
        return ("key", None) if self.lookups else None

    def entry_of(self, executable, _noted):
        return executable

    def load(self, entry):
        return None if entry in self.gone else entry


def fake_table(monkeypatch) -> tuple[ProgramTable, FakeCache]:
    monkeypatch.setattr(programs_module, "persistent_cache_on", lambda: True)
    cache = FakeCache()
    monkeypatch.setattr(programs_module, "cache_entries", cache)
    table = ProgramTable()
    table.bound(2)
    return table, cache


def loaded(table: ProgramTable) -> list:
    return [k for k, e in table._done.items() if e.executable]


def test_least_recently_called_goes_first_and_ahead_of_time_compiles_before_any_called(monkeypatch):
    table, _ = fake_table(monkeypatch)
    table.get(("a",), fake("a"))  # called
    table.get(("b",), fake("b"))  # called, later
    table.get(("c",), fake("c"), ahead=True)  # compiled ahead: evicted before a called one
    assert table.loaded() == 2 and loaded(table) == [("a",), ("b",)]
    table.get(("a",), fake("a"))  # a called again: b is now the least recently called
    table.get(("d",), fake("d"))
    assert loaded(table) == [("a",), ("d",)]
    assert table.evictions == 2 and table.reloads == 0 and len(table) == 4 and table.has(("c",))
    assert table.get(("b",), fake("b")) == "executable b"  # back from its cache entry
    assert table.reloads == 1 and table.reload_misses == 0


def test_a_program_whose_entry_is_gone_is_loaded_again_and_counted(monkeypatch):
    table, cache = fake_table(monkeypatch)
    for name in "abc":
        table.get((name,), fake(name))
    cache.gone.add("executable a")  # the bounded cache dropped it
    assert table.get(("a",), fake("a")) == "executable a"
    assert table.reloads == 1 and table.reload_misses == 1


def test_a_program_without_a_cache_entry_stays_loaded(monkeypatch):
    table, cache = fake_table(monkeypatch)
    cache.lookups = False  # no entry noted: it could not be reloaded
    for name in "abc":
        table.get((name,), fake(name))
    assert table.loaded() == 3 and table.evictions == 0


def test_a_jax_whose_compiled_programs_differ_leaves_them_loaded():
    """Another JAX's private `Compiled` parts (no `_params` here): no entry, so the program is never
    evicted, rather than a failed compile."""
    import dataclasses
    import types

    from hkserve.engine import cache_entries

    @dataclasses.dataclass
    class Unloaded:
        xla_executable: object

    compiled = types.SimpleNamespace(_executable=types.SimpleNamespace(_unloaded_executable=Unloaded("x")))
    assert cache_entries.entry_of(compiled, ("key", None)) is None


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
