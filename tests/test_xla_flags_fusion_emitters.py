"""An engine's programs on a CPU compile with XLA's fusion emitters off (engine/compiler_options.py: less
memory per loaded program, less CPU to compile, no slower: docs/benchmarks.md, "Fusion emitters off"),
unless XLA_FLAGS name the option. Seen in the optimized HLO: the fusion emitters wrap single reduce and
scatter ops as fusions of their own ("wrapped_..." computations), the older emitters wrap nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from test_paged_engine import make_runner

from hkserve.engine import compiler_options as co
from hkserve.engine.programs import ProgramTable

WRAPPED = "wrapped_"  # the fusion emitters' wrapped-op computations in `Compiled.as_text()`


def _wrapped(engine) -> list[bool]:
    """Per loaded program of `engine`: whether its optimized HLO holds fusion-emitter wrappers."""
    return [WRAPPED in e.executable.as_text() for e in engine.programs._done.values() if e.executable is not None]


@pytest.mark.parametrize("path", ["kernels", "xla"])
def test_every_program_of_an_engine_compiles_without_the_fusion_emitters(path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the programs' options are read at the engine's build
    ours, defaults = (make_runner(path, "paged", kv="bfloat16") for _ in range(2))
    assert ours.engine.programs.compiler_options[co.FUSION_EMITTERS] is False
    options = dict(ours.engine.programs.compiler_options)
    del options[co.FUSION_EMITTERS]
    defaults.engine.programs = ProgramTable(options)  # XLA's default: the fusion emitters on
    for runner in (ours, defaults):
        runner.engine.warmup()
    assert len(_wrapped(ours.engine)) >= 5 and not any(_wrapped(ours.engine))
    assert sum(_wrapped(defaults.engine)) >= 3  # the probe sees the emitters where they are on


def test_an_xla_flags_naming_the_option_wins(monkeypatch):
    f32 = {"w": jnp.zeros(2, jnp.float32)}
    for flags in ("--xla_cpu_use_fusion_emitters=true", "--xla_foo=1 --xla_cpu_use_fusion_emitters=false"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert co.FUSION_EMITTERS not in co.compiler_options(f32, f32)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters_x=1")  # another option: a name matches whole
    assert co.compiler_options(f32, f32) == {co.FUSION_EMITTERS: False}
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a CPU option: none elsewhere
    assert co.compiler_options(f32, f32) == {}
