"""One decode window where the step's attention reads each row's own length (issue 37): on the CPU
kernels' paths (int8 weights, a float model's attention-only spec; paged and static) the step-like
programs (step, and the constrained step's) compile at max_len alone, and their tokens, greedy and
sampled, alone and among neighbours across the windows' edges, equal those of the same engine forced to
the windows; XLA's gather and VQ keep their windows.

Planted and seen failing (each restored): the C++ kernel fed the window instead of each row's length
(transformer.py: `seen` = attend_len under in_place; int8-static: the tokens differ from the windowed
engine's at the 4th); the single window one smaller than max_len (256: the step_windows check, and with
that check taken out the compiled programs' list); `auto` choosing the windows on the kernels' path.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config
from test_paged_engine import neighbours, run

from hkserve.checkpoint.quantize import convert_params
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels import dispatch
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96, sliding_window=24, sliding_layers=(True, False), context_length=512)
F32 = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 7))
MAX_LEN = 300  # windows 128, 256, 300
STEP_KINDS = ("step", "masked", "forward")

needs_kernels = pytest.mark.skipif(dispatch.resolve("auto", "int8") is None, reason="no CPU kernels on this machine")


def make_engine(weights: str, windows: str = "auto", layout: str = "paged", kernels: bool = True) -> Engine:
    """A tiny model's engine (4 slots of MAX_LEN, structured: the constrained step compiles in warmup)."""
    config, params = CONFIG, F32
    if weights == "int8":
        config, params = convert_params(F32, config, "int8")
    spec = dispatch.resolve("auto", config.dtype) if kernels else None
    paged = {"block_size": 16} if layout == "paged" else {}
    shape = dict(slots=4, max_len=MAX_LEN, prefill_buckets=(8, 32), structured=True, kv_layout=layout)
    options = EngineOptions(**shape, step_windows=windows, **paged)
    return Engine(build_model(config, spec), params, options)


def step_programs(engine: Engine) -> list[tuple]:
    """The compiled step-like programs' names (kind, window)."""
    return sorted({c.program.name for c in engine.program_calls() if c.program.name[0] in STEP_KINDS and c.compiled()})


def requests() -> list[Request]:
    """Targets whose contexts cross both window edges (128, 256), and random neighbours."""
    long = [Request(list(range(1, 95)) * 2 + list(range(40)), 60, SamplingParams(temperature=0.0))]
    sampled = [Request(list(range(3, 95)), 60, SamplingParams(temperature=0.8, seed=11))]
    return long + sampled + neighbours(6, seed=3)


@needs_kernels
@pytest.mark.parametrize(("weights", "layout"), [("int8", "paged"), ("int8", "static"), ("float32", "paged")])
def test_the_kernels_path_compiles_one_step_window_with_the_windowed_tokens(weights, layout):
    one, windowed = make_engine(weights, layout=layout), make_engine(weights, "windows", layout)
    assert one.windows == windowed.windows == (128, 256, MAX_LEN)
    assert one.step_windows == (MAX_LEN,) and windowed.step_windows == windowed.windows
    one.warmup()
    windowed.warmup()
    assert step_programs(one) == [("masked", MAX_LEN), ("step", MAX_LEN)]
    assert step_programs(windowed) == sorted((k, w) for k in ("masked", "step") for w in windowed.windows)
    assert len(windowed.programs) - len(one.programs) == 2 * (len(windowed.windows) - 1)
    reqs = requests()
    tokens = run(InferenceRunner(one, max_queue=64), reqs)
    assert tokens == run(InferenceRunner(windowed, max_queue=64), reqs)
    assert max(len(r.prompt_ids) + r.max_tokens for r in reqs) > 256  # the windowed arm used every window
    assert tokens[0] == run(InferenceRunner(make_engine(weights, layout=layout), max_queue=64), reqs[:1])[0]  # alone


@needs_kernels
def test_a_forced_single_window_is_exact_off_the_kernels_too():
    """XLA's gather keeps the windows under auto; forced to one (a GPU's choice to make, say) it reads the
    whole memory, masked by each row's length: the same tokens."""
    xla = make_engine("float32", kernels=False)
    assert xla.step_windows == xla.windows == (128, 256, MAX_LEN)
    reqs = requests()[:3]
    assert run(InferenceRunner(make_engine("float32", "one", kernels=False), max_queue=64), reqs) == run(
        InferenceRunner(xla, max_queue=64), reqs
    )


def test_the_step_windows_option_is_checked():
    with pytest.raises(ValueError, match="step_windows"):
        make_engine("float32", "some", kernels=False)
