"""What an engine keeps of its programs once they are compiled (engine/programs.py): the executables only.
JAX caches each lowering (jaxpr, MLIR module with its own MLIR context) keyed weakly on the function
jitted; a program whose jitted function lived with the engine kept them for the engine's life (137 MiB
for SmolLM2's 63 programs, docs/benchmarks.md). Checked with weakrefs to each lowering on a tiny model:
every program of a warm-up, then a request that runs on the executables alone, and a speculating
engine's own programs. Planted: a Program keeping its jitted function fails both."""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers import init_params, tiny_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.programs import Program
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 5)  # the eager init's values, one jitted compile per process
OPTIONS = EngineOptions(slots=2, max_len=128, prefill_buckets=(8, 32))


@pytest.fixture
def lowerings(monkeypatch) -> list[weakref.ref]:
    """Weakrefs to what each program's lowering made: the Lowered, its computation and MLIR module."""
    refs: list[weakref.ref] = []
    lower = Program._lower

    def watched(self, args):
        lowered = lower(self, args)
        computation = lowered._lowering  # pxla.MeshComputation: the module, its compile arguments
        refs.extend(weakref.ref(x) for x in (lowered, computation, computation.stablehlo()))
        return lowered

    monkeypatch.setattr(Program, "_lower", watched)
    return refs


def alive(refs: list[weakref.ref]) -> list[str]:
    gc.collect()
    return [type(r()).__name__ for r in refs if r() is not None]


def test_no_lowering_of_a_compiled_program_stays_referenced(lowerings):
    engine = Engine(MODEL, PARAMS, OPTIONS)
    engine.warmup()
    programs = len(engine.programs)
    assert programs > 5 and len(lowerings) == 3 * programs  # every program lowered once, here
    assert alive(lowerings) == []
    # The executables alone serve a request: nothing is lowered again.
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        tokens = [t.id for t in runner.generate(Request(list(range(1, 20)), 12, SamplingParams(temperature=0.0)))]
    finally:
        runner.stop()
    assert len(tokens) == 12 and len(lowerings) == 3 * programs


def test_no_lowering_of_a_speculating_engines_own_programs_stays_referenced(lowerings):
    engine = SpeculativeEngine(Engine(MODEL, PARAMS, OPTIONS), SpecConfig(k=2))
    calls = engine._own_calls()  # its context's two programs and a verify step per window
    for call in calls:
        call.compile()
    assert len(lowerings) == 3 * len(calls)
    assert alive(lowerings) == []
