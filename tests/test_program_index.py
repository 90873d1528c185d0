"""The program index (engine/program_index.py, program_identity.py): a program's cache entry kept on
disk under a description of all its lowering depends on, so that a later engine (a warm start) loads
it from JAX's persistent cache without tracing or lowering it. Checked on a tiny model, each test with
engine options no other test file uses (its own index entries): a second engine of the same options
traces nothing and replies the same; one that differs in a value that changes no shape (a config
field, an option) misses the index and traces; in the verifying mode every indexed program is also
lowered and JAX's key compared, over several configurations one after the other (a piece missing from
the description would hit the previous configuration's entry and fail there); a corrupt index file is
ignored and rewritten.

Planted (2026-11-29, then restored): `_fields` dropping "rope_theta" and "n_top" from every object's
description made test_stale_identity_misses_and_lowers fail (7 hits where at most 1 was due) and the
verifying test raise StaleEntry at the rope_theta configuration (jit__prefill_impl: indexed key
274602a5..., JAX's b0472896...). The index reading nothing (`get` ignoring the file) made
test_startup's warm-start check fail ((index hits, misses) (0, 18), not (18, 0))."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.engine import program_index
from hkserve.engine.background_compile import Compiles
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=80)
PARAMS = init_params(CONFIG, 11)
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture
def work(monkeypatch) -> dict[str, int]:
    """JAX's traces and lowerings while the test runs, with the index on (its verifying mode, which a
    run may set for the whole suite, lowers every indexed program as well)."""
    monkeypatch.delenv(program_index.ENV, raising=False)
    seen = {"traces": 0, "lowerings": 0}

    def on_span(event, _secs, **_):
        seen["traces"] += event == TRACE
        seen["lowerings"] += event == LOWER

    jax.monitoring.register_event_duration_secs_listener(on_span)
    yield seen
    jax.monitoring.unregister_event_duration_listener(on_span)


def engine(options: EngineOptions, config=CONFIG, work: dict | None = None) -> Engine:
    """An engine with every program of a start loaded (from the index where it has them); `work`:
    zeroed once the engine is built (its state's and params' own jits are not the table's programs)."""
    e = Engine(build_model(config), PARAMS, options)
    if work is not None:
        work.update(traces=0, lowerings=0)
    Compiles(e, "eager").before_ready()
    return e


def replies(e: Engine) -> list:
    runner, out = InferenceRunner(e), []
    for request in (Request(list(range(1, 30)), 10, SamplingParams(temperature=0.7, seed=3)),
                    Request([5, 6, 7], 6, logprobs=2)):  # fmt: skip
        stream = runner.submit(request)
        while runner.iterate():
            pass
        out.append([(ev.token, ev.prompt) for ev in stream if ev.token or ev.prompt])
    return out


def test_a_second_engine_traces_and_lowers_nothing_and_replies_the_same(work):
    options = EngineOptions(slots=3, max_len=128, prefill_buckets=(16,))
    first = engine(options)
    expected = replies(first)
    programs = len(first.programs)
    second = engine(options, work=work)
    assert len(second.programs) == programs > 3
    status = second.programs.status()
    assert (status["index_hits"], status["index_misses"]) == (programs, 0)
    assert work == {"traces": 0, "lowerings": 0}
    assert replies(second) == expected


def test_stale_identity_misses_and_lowers(work):
    """A value that changes no shape, in the model config or the engine options: its programs miss."""
    options = EngineOptions(slots=3, max_len=128, prefill_buckets=(24,))
    engine(options)
    for config, opts in ((dataclasses.replace(CONFIG, rope_theta=500.0), options),
                         (CONFIG, dataclasses.replace(options, n_top=3))):  # fmt: skip
        e = engine(opts, config, work)
        status = e.programs.status()
        # every program but the block table's (prefix_copy.set_table: neither model nor options in it)
        assert status["index_hits"] <= 1 and status["index_misses"] == len(e.programs) - status["index_hits"] > 3
        assert work["lowerings"] == status["index_misses"]


def test_verifying_mode_finds_every_indexed_key_equal_to_jax_s(monkeypatch):
    """Configurations one after the other, each once to index it and once to verify it; each differs
    from the one before in one thing, so a description that missed it would hit the previous one's
    entries and JAX's key would differ (StaleEntry)."""
    monkeypatch.setenv(program_index.ENV, "verify")
    base = EngineOptions(slots=2, max_len=160, prefill_buckets=(16,))
    runs = [
        (CONFIG, base),
        (dataclasses.replace(CONFIG, rope_theta=777.0), base),
        (CONFIG, dataclasses.replace(base, kv_layout="static")),
        (CONFIG, dataclasses.replace(base, structured=True)),
        (CONFIG, dataclasses.replace(base, prefix_cache="exact")),
        (CONFIG, dataclasses.replace(base, split_masks=True, structured=True)),
        (CONFIG, dataclasses.replace(base, n_top=2)),
    ]
    for config, options in runs:
        engine(options, config)  # indexes what the one before did not
        verified = engine(options, config)
        status = verified.programs.status()
        assert status["index_misses"] == 0 and status["index_hits"] == len(verified.programs)


def test_a_corrupt_index_file_is_ignored_and_rewritten():
    options = EngineOptions(slots=3, max_len=96, prefill_buckets=(16,))
    first = engine(options)
    path = first.programs.index().path
    path.write_bytes(np.random.default_rng(0).bytes(300))
    second = engine(options)
    assert second.programs.status()["index_misses"] == len(second.programs)
    third = engine(options)
    assert third.programs.status()["index_hits"] == len(third.programs)


def test_two_writers_of_one_identity_keep_both_entries(tmp_path, monkeypatch):
    """Processes of one identity (the suite's xdist workers, replicas on one cache volume) each read the
    file when they open it; a write merges with the file under a lock, so neither drops the other's
    entries. The last writer did: in a fresh-clone run a second engine of the same options missed 4 of
    its 7 programs, their entries overwritten by the other worker's file (planted: the merge removed,
    this test fails with only "a" kept)."""
    monkeypatch.setattr(program_index, "dumps", lambda entry: entry.encode())
    first, second = (program_index.ProgramIndex(tmp_path, "same") for _ in range(2))
    second.put("b", "B")
    first.put("a", "A")
    assert program_index.ProgramIndex(tmp_path, "same")._data == {"a": b"A", "b": b"B"}
