"""A bfloat16 KV memory on the CPU is written in place, not through a float32 copy of it (issue 37):
XLA:CPU's bf16 normalization widened the whole memory for every write (engine/compiler_options.py), so
each program's temp memory held a float32 copy of it. Tiny models: every program's temp stays under
the bf16 memory's own size, and outputs and the memory's bits equal those of programs compiled with the
pass on (the default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_engine import TARGETS, make_runner, neighbours, run

from hkserve.engine import compiler_options as co
from hkserve.engine.programs import ProgramTable


def _temps(engine) -> dict:
    return {key: c.executable.memory_analysis().temp_size_in_bytes for key, c in engine.programs._done.items()}


def test_bf16_kv_programs_hold_no_float32_copy_of_the_memory():
    """With the pass on, each program's temp held the pool widened (k and v: 4x one bf16 array). Paged:
    a pool larger than the programs' own temps (a static step's reads of every row's window in float32
    are as large as its memory)."""
    runner = make_runner("xla", "paged", slots=8, kv="bfloat16", kv_cache_mb=4)
    engine = runner.engine
    engine.warmup()
    k = engine.state.memory.k
    assert k.dtype == jnp.bfloat16 and k.nbytes >= 2**20
    temps = _temps(engine)
    assert len(temps) >= 6  # prefill buckets and chunks, rows and step programs
    assert max(temps.values()) < k.nbytes, {key[:2]: t for key, t in temps.items() if t >= k.nbytes}


@pytest.mark.parametrize("path", ["xla", "kernels"])
def test_outputs_and_memory_bits_equal_those_of_the_widening_programs(path):
    requests = [*TARGETS, *neighbours(6, seed=5)]
    ours, widening = (make_runner(path, "paged", kv="bfloat16") for _ in range(2))
    widening.engine.programs = ProgramTable()  # XLA's defaults: the bf16 writes widened
    assert ours.engine.programs.compiler_options and not widening.engine.programs.compiler_options
    assert run(ours, requests) == run(widening, requests)
    for name in ("k", "v"):
        mine, theirs = (np.asarray(getattr(r.engine.state.memory, name)).view(np.uint16) for r in (ours, widening))
        assert np.array_equal(mine, theirs)


def test_the_pass_is_left_on_for_bf16_params_f32_memories_and_other_backends(monkeypatch):
    f32, bf16 = jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.bfloat16)
    assert co.compiler_options({"w": f32}, {"k": bf16}) == {co.DISABLE: co.BF16_NORMALIZATION}
    assert co.compiler_options({"w": jnp.zeros(2, jnp.int8)}, {"k": bf16, "step": jnp.zeros(2, jnp.int32)})
    assert co.compiler_options({"w": bf16}, {"k": bf16}) == {}  # the CPU's dots need the pass
    assert co.compiler_options({"w": f32}, {"k": f32}) == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert co.compiler_options({"w": f32}, {"k": bf16}) == {}
