"""The host-side queries of a ServingEngine (protocols.py) answered by the engine a wrapper wraps
(`inner`): SpeculativeEngine and multihost's LeaderEngine forward these explicitly, so the Protocol
sees each member, instead of handing every unknown name on with __getattr__. Read at each use: an
engine's `positions` is replaced when it resets."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hkserve.engine.protocols import ServingEngine


def _query(read: Callable[[ServingEngine], object]) -> property:
    return property(lambda self: read(self.inner))


def base_engine(engine):
    """The Engine under its wrappers (SpeculativeEngine, LeaderEngine: ForwardsQueries.inner)."""
    while hasattr(engine, "inner"):
        engine = engine.inner
    return engine


class ForwardsQueries:
    inner: ServingEngine  # the wrapped engine, set by the wrapper

    slots = _query(lambda e: e.slots)
    max_len = _query(lambda e: e.max_len)
    n_top = _query(lambda e: e.n_top)
    vocab_size = _query(lambda e: e.vocab_size)
    prefix_cache = _query(lambda e: e.prefix_cache)
    prefill_chunk = _query(lambda e: e.prefill_chunk)
    prefill_buckets = _query(lambda e: e.prefill_buckets)
    positions = _query(lambda e: e.positions)  # [B], mutated in place by the wrappers
    kv_layout = _query(lambda e: e.kv_layout)
    kv_pool = _query(lambda e: e.kv_pool)
    step_tokens = _query(lambda e: e.step_tokens)

    def check_fits(self, prompt_len: int, max_tokens: int = 0) -> None:
        self.inner.check_fits(prompt_len, max_tokens)

    def release(self, slot: int, keep: bool = False, written: Sequence[int] = ()) -> None:
        self.inner.release(slot, keep, written)
