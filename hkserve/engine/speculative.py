"""Speculative decoding around an Engine: n-gram drafts proposed and verified inside one compiled
[B, K+1] step (hkserve/engine/verify.py), so the runner keeps its one-step-behind pipelining.

`SpeculativeEngine` offers the Engine's interface, so the runner drives it unchanged except that a
step's row may carry several tokens. It keeps each slot's tokens on the device (the context the
lookup searches) and decides per step, with SpecPolicy, whether to verify or to take the Engine's
own plain step. KV memory only: a Transformer-VQ memory cannot take back rejected positions.
Under the paged layout a verify step's rows get blocks for all their k+1 positions before it is
dispatched (`_grow_drafts`); the runner counts them in its block promises (`step_tokens`).

The host mirror of each slot's position (`engine.positions`, which picks the attention window) is
an upper bound while a verify step is in flight and exact again once its output is read.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hkserve.engine.engine import Engine
from hkserve.engine.forwarding import ForwardsQueries
from hkserve.engine.outputs import PendingTokens, Token
from hkserve.engine.prefill_job import OneShotPrefill
from hkserve.engine.programs import Program, abstract
from hkserve.engine.spec_policy import SpecConfig, SpecCounts, SpecPolicy
from hkserve.engine.verify import EXTRA, append_inputs, verify_step, write_prompt
from hkserve.engine.warmup import ProgramCall, after_ready, before_ready
from hkserve.model.ngram import first_draft


class _Flight(NamedTuple):
    grow: np.ndarray  # [B] how far each slot's position may have advanced in this step
    epoch: np.ndarray  # [B] each slot's request generation when the step was dispatched
    drafting: np.ndarray  # [B] bool: rows that could draft (a verify step's evidence for the policy)


class PendingSpec:
    """A step's tokens on the device (see PendingTokens): `read()` gives each row's tokens as a list,
    several where drafts were accepted (an idle row's entry is junk, as in PendingTokens)."""

    def __init__(self, owner: SpeculativeEngine, seq: int, packed: jax.Array | None, plain: PendingTokens | None):
        self.owner, self.seq, self.packed, self.plain = owner, seq, packed, plain
        if packed is not None:
            packed.copy_to_host_async()

    def read(self) -> list[list[Token]]:
        flight = self.owner._flights.pop(self.seq, None)  # None: the engine was reset since
        if self.plain is not None:
            rows = [[t] for t in self.plain.read()]
            for slot, row in enumerate(rows):
                if flight is not None and flight.grow[slot]:
                    self.owner._emitted(slot, flight.epoch[slot], row, plain=True)
            return rows
        host = np.asarray(self.packed)  # [B, K+1, 2 + 2n + EXTRA]
        n = (host.shape[2] - 2 - EXTRA) // 2
        rows = []
        for slot, row in enumerate(host):
            emitted, drafted, step = (int(x) for x in row[0, -EXTRA:])
            rows.append(
                [
                    Token(
                        int(r[0]),
                        float(r[1]),
                        list(zip(r[2 : 2 + n].astype(np.int64).tolist(), r[2 + n : 2 + 2 * n].tolist())),
                    )
                    for r in row[:emitted]
                ]
            )
            if emitted and flight is not None:
                self.owner._settle(self.seq, slot, flight, step, drafted, emitted)
                self.owner._emitted(slot, flight.epoch[slot], rows[-1], plain=False)
        return rows


class _PrefillRead:
    """A prefill's first token, also noted in the slot's host history."""

    def __init__(self, owner: SpeculativeEngine, pending: PendingTokens, slot: int):
        self.owner, self.pending, self.slot, self.epoch = owner, pending, slot, owner._epoch[slot]

    def read(self) -> list[Token]:
        tokens = self.pending.read()
        self.owner._emitted(self.slot, self.epoch, tokens[:1], plain=False)
        return tokens


class SpeculativeEngine(OneShotPrefill, ForwardsQueries):
    """An Engine that drafts with n-gram lookup and verifies the drafts in one step."""

    def __init__(self, engine: Engine, config: SpecConfig | None = None):
        if engine.model.config.memory != "kv":
            raise ValueError("speculative decoding needs a KV memory (a VQ memory cannot drop rejected tokens)")
        self.inner: Engine = engine  # its queries (slots, max_len, positions, ...) are forwarded: ForwardsQueries
        self.config = config or SpecConfig()
        self.policy = SpecPolicy(self.config, engine.slots)
        self._epoch = np.zeros(engine.slots, np.int64)
        self._history: list[list[int]] = [[] for _ in range(engine.slots)]  # host copy of each slot's tokens
        # Steps dispatched and not yet read, by sequence number (a runner stopped mid-step never reads
        # its last one: such entries only make later bounds looser, and are dropped after a while).
        self._flights: dict[int, _Flight] = {}
        self._seq = 0
        self._context_sharding = NamedSharding(engine.mesh, P("data", None))
        self._compiled: dict[tuple[str, int], Program] = {}
        self._new_context()
        self._context_spec = abstract(self.context)  # what every lowering takes for it

    @property
    def step_tokens(self) -> int:
        """Positions one step may write per row: a verify step's input token and k drafts."""
        return self.config.k + 1

    @property
    def counts(self) -> SpecCounts:
        return self.policy.counts

    def spec_counts(self) -> SpecCounts:
        return self.policy.counts

    def _new_context(self) -> None:
        shape = (self.inner.slots, self.inner.max_len)
        self.context = jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=self._context_sharding)()

    def reset(self) -> None:
        self.inner.reset()
        self._new_context()
        self._flights.clear()

    # -- compiled programs ----------------------------------------------------------------------
    def _fn(self, kind: str, attend_len: int = 0) -> Program:
        """The program of `kind` ("verify" at a window, "append", "prompt"), compiled ahead of time on
        first use in the Engine's table (programs.py), like the Engine's own."""
        key = (kind, attend_len)
        if key not in self._compiled:
            e, rep, ctx = self.inner, self.inner._sharding(), self._context_sharding
            (params_spec, state_spec), context_spec = e._specs, self._context_spec
            if kind == "verify":
                c = self.config
                fn = functools.partial(verify_step, e.model, e.n_top, c.k, c.ngram_sizes, attend_len)
                in_sh, out_sh = (e.param_shardings, e.state_shardings, ctx, rep, rep), (e.state_shardings, ctx, rep)
                jit_options = dict(in_shardings=in_sh, out_shardings=out_sh, donate_argnums=(1, 2))
                fixed = {0: params_spec, 1: state_spec, 2: context_spec}
            elif kind == "append":
                in_sh = (e.state_shardings, ctx, rep)
                fn, jit_options = append_inputs, dict(in_shardings=in_sh, out_shardings=ctx, donate_argnums=(1,))
                fixed = {0: state_spec, 1: context_spec}
            else:
                fn, jit_options = (
                    write_prompt,
                    dict(in_shardings=(ctx, rep, rep), out_shardings=ctx, donate_argnums=(0,)),
                )
                fixed = {0: context_spec}
            self._compiled[key] = Program(e.programs, ("speculative", *key), fn, fixed, **jit_options)
        return self._compiled[key]

    def _own_calls(self) -> list[ProgramCall]:
        """This engine's programs: the context's two (a prompt written, a plain step's inputs appended)
        and a verify step per window."""
        e = self.inner
        active = np.zeros(e.slots, bool)
        return [
            ProgramCall(0, self._fn("prompt"), (np.int32(0), np.zeros(e.max_len, np.int32))),
            ProgramCall(0, self._fn("append"), (active,)),
            *(ProgramCall(w, self._fn("verify", w), (active, active)) for w in e.windows),
        ]

    def program_calls(self) -> list[ProgramCall]:
        """The Engine's inventory (warmup.py) and this engine's programs, smallest context first."""
        return sorted([*self.inner.program_calls(), *self._own_calls()], key=lambda c: c.context)

    def rare_calls(self, upto: int | None) -> list[ProgramCall]:
        """What `warmup(upto)` leaves out and is not compiled since (warmup.py)."""
        return after_ready(self.program_calls(), upto)

    # -- the Engine's interface -----------------------------------------------------------------
    def _started(self, slot: int, prompt_ids) -> None:
        row = np.zeros(self.inner.max_len, np.int32)
        row[: len(prompt_ids)] = prompt_ids
        self.context = self._fn("prompt")(self.context, np.int32(slot), row)
        self._epoch[slot] += 1
        self._history[slot] = list(prompt_ids)
        self.policy.restart(slot)

    def _emitted(self, slot: int, epoch: int, tokens: list[Token], plain: bool) -> None:
        """A slot's tokens as read: kept on the host, and while the slot rests, checked against what
        the lookup would have proposed (SpecPolicy.shadow)."""
        if epoch != self._epoch[slot]:
            return
        history, sizes = self._history[slot], self.config.ngram_sizes
        for token in tokens:
            if plain and self.policy.resting(slot):
                # Only the longest suffix counts: short matches are often right by chance in free text.
                self.policy.shadow(slot, first_draft(history, sizes) == (token.id, max(sizes)))
            history.append(token.id)

    # Grammar-constrained steps go through the Engine's split step, which this context does not follow;
    # the runner refuses constrained requests on a speculating engine.
    supports_grammars = False

    def rows_program(self, prompt_len: int) -> None:
        """No batched prefill: every prompt's tokens reach the context through `prefill`."""
        return None

    def prefill_many(self, slots, prompts, settings):
        raise ValueError("a speculating engine has no batched prefill (rows_program is None)")

    def step_forward(self, active: np.ndarray):
        raise ValueError("structured outputs and tool calls are not supported with --speculative ngram")

    def step_sample(self, forward, bitmask: np.ndarray):
        raise ValueError("structured outputs and tool calls are not supported with --speculative ngram")

    def prefill(self, slot: int, prompt_ids, settings=None, **keywords) -> _PrefillRead:
        """The Engine's prefill (with a prefix cache's `reuse`: the context takes the whole prompt all the same)."""
        pending = self.inner.prefill(slot, prompt_ids, settings, **keywords)
        self._started(slot, prompt_ids)
        return _PrefillRead(self, pending, slot)

    def score_prefill(self, slot: int, prompt_ids, settings=None, **keywords):
        pending, scores = self.inner.score_prefill(slot, prompt_ids, settings, **keywords)
        self._started(slot, prompt_ids)
        return _PrefillRead(self, pending, slot), scores

    def step(self, active: np.ndarray) -> PendingSpec:
        """One step for the active slots [B]: a verify step when the policy has slots drafting, else
        the Engine's plain step (after adding the inputs to the context)."""
        e = self.inner
        active = np.asarray(active, bool)
        drafting = self.policy.plan(active)
        top = e.max_len - 1  # a slot still owed tokens never starts a step past it (see _settle)
        if drafting is None:
            self.context = self._fn("append")(e.state, self.context, active)
            np.minimum(e.positions, top, out=e.positions)
            pending = PendingSpec(self, self._seq, None, e.step(active))
            grow, drafting = active.astype(np.int64), np.zeros_like(active)
        else:
            needed = int(e.positions[active].max())
            self._grow_drafts(active, drafting)
            e.state, self.context, packed = self._fn("verify", e._window(max(needed, 1)))(
                e.params, e.state, self.context, active, drafting
            )
            grow = active * (1 + self.config.k * drafting)
            pending = PendingSpec(self, self._seq, packed, None)
        self._flights = {seq: f for seq, f in self._flights.items() if seq > self._seq - 8}
        self._flights[self._seq] = _Flight(grow, self._epoch.copy(), drafting)
        self._seq += 1
        if drafting.any():
            e.positions += grow
        np.minimum(e.positions, top, out=e.positions)
        return pending

    def _grow_drafts(self, active: np.ndarray, drafting: np.ndarray) -> None:
        """Paged: each active row holds blocks for every position the verify step may write (its input
        token and k drafts, from its position's upper bound), before it is dispatched. Rejected drafts'
        blocks stay the slot's, for the tokens it writes next, until its memory is truncated or dropped.
        The runner promised them (Row.tokens counts `step_tokens`), so the shard has them free."""
        e = self.inner
        if e.kv_pool is None:
            return
        for slot in np.flatnonzero(active):
            reach = int(e.positions[slot]) + 1 + self.config.k * bool(drafting[slot])
            e.kv_pool.grow(int(slot), min(reach, e.max_len))
        e.sync_table()

    def _settle(self, seq: int, slot: int, flight: _Flight, step: int, drafted: int, emitted: int) -> None:
        """A verify step's exact outcome for one slot: its position and the policy's evidence."""
        if flight.epoch[slot] != self._epoch[slot]:
            return  # the slot holds another request now
        later = sum(
            int(f.grow[slot]) for s, f in self._flights.items() if s > seq and f.epoch[slot] == self._epoch[slot]
        )
        self.inner.positions[slot] = min(step + later, self.inner.max_len - 1)
        if flight.drafting[slot]:
            self.policy.observe(slot, drafted, emitted)

    def warmup(self, upto: int | None = None) -> None:
        """The Engine's programs and this engine's (those up to `upto` tokens of context: warmup.py)
        compiled ahead of time; then what a compile cannot prove run once: a prompt, a plain step's
        append and a verify step at the smallest window."""
        e = self.inner
        for call in before_ready(self._own_calls(), upto):
            call.compile()
        e.warmup(upto)
        first = np.eye(e.slots, dtype=bool)[0]
        self._started(0, [0])
        self.context = self._fn("append")(e.state, self.context, first)
        e.state, self.context, packed = self._fn("verify", e.windows[0])(e.params, e.state, self.context, first, first)
        np.asarray(packed)
        e.positions[:] = 0
        self.policy.restart(0)
