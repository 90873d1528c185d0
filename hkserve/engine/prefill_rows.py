"""Batched prefill: several short prompts in one compiled call of fixed shape [P, bucket].

A burst of requests otherwise prefills one prompt per device call, and on a CPU a one-row prefill of
a short prompt costs nearly as much as several rows (the weights are streamed once per call either
way). So a prompt that fits one bucket is prefilled by the "rows" program of its bucket: P rows, each
its own slot, unused rows padded (length 0, slot index = the slot count: out of range, so every
write of theirs is dropped).

Batch invariance: the program of a bucket always has the same P rows, whether one prompt or P fill
them, so a request's first token (and everything after) does not depend on its batch mates. Which
program a request takes depends on its own prompt only (its length, whether it is scored), never on
what else is waiting.

P per bucket: `max_rows` for the smallest bucket, halving as the bucket doubles, so every rows
program costs about the same `max_rows × smallest bucket` tokens and a lone short prompt pays at
most that; larger buckets (one row) keep the one-row prefill.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.engine.programs import Program
from hkserve.model.memory import reset_slot
from hkserve.model.sampling import SamplingParams, TokenHistory, make_settings


def rows_by_bucket(buckets: Sequence[int], max_rows: int) -> dict[int, int]:
    """Rows of each bucket's program: max_rows at the smallest bucket, halving as the bucket doubles.
    Buckets left with one row have no rows program: their prompts take Engine.prefill's own."""
    if max_rows < 2 or not buckets:
        return {}
    budget = max_rows * min(buckets)
    return {b: min(max_rows, budget // b) for b in buckets if budget // b >= 2}


class RowPrefill:
    """The rows programs of one Engine (compiled per bucket), and the host call that fills them."""

    def __init__(self, engine: Any, max_rows: int):  # the Engine (engine.py imports this module)
        self.engine = engine
        # VQ memory keeps its own slot bookkeeping: its prompts take the one-row path.
        supported = engine.model.config.memory != "vq"
        self.rows = rows_by_bucket(engine.prefill_buckets, max_rows) if supported else {}
        self._compiled: Program | None = None

    def program_for(self, prompt_len: int) -> tuple[int, int] | None:
        """(bucket, rows) of the rows program that takes a prompt of this length, or None (one-row path)."""
        if not self.rows or prompt_len == 0 or prompt_len > max(self.rows):
            return None
        buckets = sorted(self.rows)
        bucket = buckets[bisect.bisect_left(buckets, prompt_len)]
        return bucket, self.rows[bucket]

    def _impl(self, params, state, tokens, lengths, slots, settings):
        """tokens [P, T] into slots [P] (lengths [P], 0 for padding rows) from empty; sample each row's
        first token. Mirrors Engine._fill / _sample_first for P rows."""
        engine = self.engine
        vocab = engine.model.config.vocab_size
        p, t = tokens.shape
        real = jnp.arange(t)[None, :] < lengths[:, None]  # [P, T]
        seen = jnp.zeros((p, vocab), bool)
        seen = seen.at[jnp.arange(p)[:, None], jnp.where(real, tokens, vocab)].set(True, mode="drop")  # [P, V]
        memory = reset_slot(state.memory, slots)
        history = TokenHistory(
            state.history.counts.at[slots].set(0, mode="drop"),
            state.history.in_prompt.at[slots].set(seen, mode="drop"),
        )
        state = state._replace(memory=memory, history=history)
        logits, memory = engine.model.forward(params, tokens, state.memory, lengths, slots, 0, True)  # [P, V]
        return engine._sample_first(state._replace(memory=memory), logits, slots, settings, None)  # no grammar

    def _fn(self) -> Program:
        """The rows program (one executable per bucket: its tokens' shape), compiled ahead of time on
        first use in the engine's table (programs.py)."""
        if self._compiled is None:
            engine = self.engine
            rep = engine._sharding()
            in_sh = (engine.param_shardings, engine.state_shardings, rep, rep, rep, rep)
            params_spec, state_spec = engine._specs
            fixed = {0: params_spec, 1: state_spec}
            jit_options = dict(in_shardings=in_sh, out_shardings=(engine.state_shardings, rep), donate_argnums=(1,))
            self._compiled = Program(engine.programs, ("rows", 0), self._impl, fixed, **jit_options)
        return self._compiled

    def prefill(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]], settings: Sequence[SamplingParams | None]
    ) -> jax.Array:
        """Prefill prompt i into slots[i] (all in one bucket's program, at most its rows) → the packed
        sampled first tokens [P, ...], row i for prompt i. Raises ValueError before any device work
        for prompts or settings the program cannot take."""
        engine = self.engine
        programs = {self.program_for(len(p)) for p in prompts}
        if None in programs or len(programs) != 1:
            raise ValueError(f"prompts of lengths {[len(p) for p in prompts]} do not share one rows program")
        bucket, p = programs.pop()
        if not 1 <= len(prompts) <= p or len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise ValueError(f"{len(prompts)} prompts for {len(slots)} distinct slots, at most {p} rows")
        args = self.args(bucket, p, slots, prompts, settings)  # a bad setting raises here, before any device work
        for slot, prompt in zip(slots, prompts):  # paged: each slot's blocks (raises before device work)
            engine._assign(slot, len(prompt))
        engine.sync_table()
        engine.state, out = self._fn()(engine.params, engine.state, *args)
        for slot, prompt in zip(slots, prompts):
            engine.positions[slot] = len(prompt)
            engine._cache_prompt(slot, prompt, exact=False)  # not the fixed-chunk program's KV
        return out

    def args(self, bucket: int, p: int, slots, prompts, settings) -> tuple:
        """The rows program's host arguments (after the params and the state): prompt i into slots[i]."""
        engine = self.engine
        tokens = np.zeros((p, bucket), np.int32)
        lengths = np.zeros(p, np.int32)
        rows = np.full(p, engine.slots, np.int32)  # padding rows: an out-of-range slot
        for i, (slot, prompt) in enumerate(zip(slots, prompts)):
            tokens[i, : len(prompt)], lengths[i], rows[i] = prompt, len(prompt), slot
        filled = list(settings) + [None] * (p - len(prompts))
        return tokens, lengths, rows, make_settings([s or SamplingParams() for s in filled], engine.vocab_size)
