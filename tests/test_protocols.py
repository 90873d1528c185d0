"""Every implementation of the serving interfaces (hkserve/engine/protocols.py) has every member the
Protocol names, methods with the Protocol's parameters: the real engines and runner, and the fakes
the runner and API tests stand on (a fake that lacks a member would make those tests pass against an
interface no real class has)."""

from __future__ import annotations

import inspect
import types

import pytest
from fake_engine import FakeEngine
from helpers import init_params, tiny_config
from http_helpers import FakeRunner

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.protocols import ServingEngine, ServingRunner
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.multihost.hosts import LeaderEngine


def protocol_members(protocol) -> dict[str, object]:
    """The Protocol's own members: name → its function, or None for a declared attribute."""
    members = {name: None for name in protocol.__annotations__}
    members.update({name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and name[0] != "_"})
    return members


def missing(obj, protocol) -> list[str]:
    """The members `obj` lacks, or whose method cannot be called as the Protocol's is: its parameters
    without a default by position, those with one by name."""
    out = []
    for name, fn in protocol_members(protocol).items():
        if not hasattr(obj, name):
            out.append(name)
        elif fn is not None:
            params = list(inspect.signature(fn).parameters.values())[1:]  # without self
            args = [p.name for p in params if p.default is inspect.Parameter.empty]
            keywords = {p.name: None for p in params if p.default is not inspect.Parameter.empty}
            try:
                inspect.signature(getattr(obj, name)).bind(*args, **keywords)
            except TypeError as e:
                out.append(f"{name}: {e}")
    return out


@pytest.fixture(scope="module")
def engine():
    config = tiny_config()
    return Engine(
        build_model(config), init_params(config, 0), EngineOptions(slots=2, max_len=64, prefill_buckets=(16,))
    )


def test_the_protocols_name_what_the_runner_and_the_api_use():
    engine_members, runner_members = protocol_members(ServingEngine), protocol_members(ServingRunner)
    assert {"prefill", "step", "step_forward", "supports_grammars", "prefix_cache", "spec_counts"} <= set(
        engine_members
    )
    assert {"submit", "cancel", "stats", "ready", "max_queue", "observe_masks", "spec_counts"} <= set(runner_members)


def test_engines_have_every_member_of_serving_engine(engine):
    leader = LeaderEngine(FakeEngine(), types.SimpleNamespace(broadcast=lambda message: None))
    speculative = SpeculativeEngine(engine, SpecConfig(k=2))
    for impl in (FakeEngine(), engine, speculative, leader):
        assert missing(impl, ServingEngine) == [], type(impl).__name__
    assert engine.supports_grammars and not speculative.supports_grammars
    assert engine.spec_counts() is None and speculative.spec_counts() is speculative.counts


def test_runners_have_every_member_of_serving_runner():
    for impl in (FakeRunner([1, 2]), InferenceRunner(FakeEngine())):
        assert missing(impl, ServingRunner) == [], type(impl).__name__


def test_a_missing_member_or_parameter_is_reported():
    class OtherParameters(FakeEngine):
        def prefill(self, slot, prompt_ids, settings=None, reuse=None):  # no bitmask
            return super().prefill(slot, prompt_ids, settings, reuse)

    fake = FakeRunner([1])
    everything_but = types.SimpleNamespace(
        **{n: getattr(fake, n) for n in protocol_members(ServingRunner) if n != "cancel"}
    )
    assert missing(everything_but, ServingRunner) == ["cancel"]
    assert missing(OtherParameters(), ServingEngine) == ["prefill: got an unexpected keyword argument 'bitmask'"]
