"""The device side of serving (JetStream's "engine"): compiled prefill-into-slot and one decode step
for all slots over a batched KV memory. No threads, no requests: whoever owns the engine calls it.

Shapes are fixed so compiles are few: prompts are padded to a prefill bucket, and the decode step reads
the past through an attention window chosen from a few sizes by the longest active slot (tracked on the
host, so choosing it needs no device sync). Where the step's attention reads each row's own length (the
CPU kernels': model/attention.py `reads_own_length`) the window changes nothing but the program count,
so the step-like programs (step, and the constrained step's masked/forward) take one, max_len. The
decode state is donated to each call: the KV memory is updated in place.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hkserve.engine.compiler_options import compiler_options
from hkserve.engine.options import STEP_WINDOWS, EngineOptions
from hkserve.engine.outputs import PendingLogits, PendingTokens, pack, score_targets
from hkserve.engine.paged_slots import PagedSlots
from hkserve.engine.prefill_rows import RowPrefill
from hkserve.engine.prefix_cache import MODES
from hkserve.engine.prefix_copy import EXACT_CHUNK, copy_prefix, set_table
from hkserve.engine.programs import Program, ProgramTable, abstract
from hkserve.engine.prompt_prefill import PromptPrefill
from hkserve.engine.state import (
    ContextLengthError,
    DecodeState,
    check_context,
    check_options,
    state_shardings,
    window_sizes,
)
from hkserve.engine.warmup import Warmup
from hkserve.model.attention import reads_own_length
from hkserve.model.build import param_shapes
from hkserve.model.memory import reset_slot
from hkserve.model.model import Model
from hkserve.model.sampling import SamplingParams, TokenHistory, empty_history, make_settings, sample
from hkserve.model.sharding import check_slots, param_shardings, parse_mesh


class Engine(PromptPrefill, PagedSlots, Warmup):
    """Owns params and the batched decode state on a ("data", "model") mesh.

    Not thread-safe: one thread (the runner's loop) calls it. A ServingEngine (protocols.py). Its paged
    layout: paged_slots.py; a prompt's prefill, whole or pass by pass: prompt_prefill.py; the programs
    it compiles before serving: warmup.py.
    """

    supports_grammars = True  # step_forward / step_sample and a prefill's first-token bitmask
    step_tokens = 1  # positions one step writes per row (a speculating engine's verify step: k+1)

    def __init__(self, model: Model, params, options: EngineOptions = EngineOptions(), mesh: Mesh | None = None):
        """`options`: how it is built (EngineOptions); `mesh`: the devices (default: the first one)."""
        slots, max_len, prefill_buckets, n_top = options.slots, options.max_len, options.prefill_buckets, options.n_top
        prefill_rows, structured, prefix_cache = options.prefill_rows, options.structured, options.prefix_cache
        split_masks = options.split_masks
        kv_layout, kv_cache_mb, block_size = options.kv_layout, options.kv_cache_mb, options.block_size
        config = model.config
        self.structured = structured
        self.split_masks = jax.default_backend() != "cpu" if split_masks is None else split_masks
        self._all_allowed = np.full((1, (config.vocab_size + 31) // 32), -1, np.int32)  # [1, W]: no grammar
        self._all_allowed_rows = np.full((slots, (config.vocab_size + 31) // 32), -1, np.int32)  # [B, W]
        check_options(config, prefix_cache, MODES)
        max_len = min(max_len, config.context_length)
        self.mesh = mesh or parse_mesh("1x1", devices=jax.devices()[:1])
        check_slots(slots, self.mesh)
        self.model, self.slots, self.max_len, self.n_top = model, slots, max_len, n_top
        self.vocab_size = config.vocab_size
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b <= max_len)) or (max_len,)
        self.prefix_cache = prefix_cache  # "exact": every prefill in fixed chunks (prefix_copy.plan_chunks)
        self.prefill_chunk = min(EXACT_CHUNK, max_len) if prefix_cache == "exact" else None
        # A VQ memory has no length axis: its step costs the same at any position, one window does.
        self.windows = (max_len,) if config.memory == "vq" else window_sizes(max_len, min(128, max_len))

        self.param_shardings = param_shardings(param_shapes(config), self.mesh, config)
        self.params = jax.device_put(params, self.param_shardings)
        if model.prepare is not None:  # what serving derives from the params once, not in every step
            shapes = jax.eval_shape(model.prepare, param_shapes(config))
            self.param_shardings = param_shardings(shapes, self.mesh, config)
            self.params = jax.jit(model.prepare, out_shardings=self.param_shardings)(self.params)
        self._size_pool(config, kv_layout, kv_cache_mb, block_size)
        self.state_shardings = state_shardings(config, self.mesh, self.kv_layout)
        self.reset()
        self.step_windows = self._step_windows(options.step_windows)
        self._specs = (abstract(self.params), abstract(self.state))  # what every lowering takes for them
        self.programs = ProgramTable(compiler_options(*self._specs))  # every compiled program, by key (programs.py)
        self._compiled: dict[tuple[str, int], Program] = {}
        self.row_prefill = RowPrefill(self, prefill_rows)  # batched prefill of short prompts (prefill_rows.py)

    def _step_windows(self, choice: str) -> tuple[int, ...]:
        """The windows of the step-like programs (step, masked, forward): one, max_len, where the step's
        attention reads each row's own length (C++ kernel: the program does not read the window, and
        costs the same at 128 and 2048: docs/benchmarks.md), else `windows` (a VQ memory's: one already),
        paid for by size on the paths that read the whole window (XLA's gather, the Pallas kernel).
        `choice`: options.STEP_WINDOWS."""
        if choice not in STEP_WINDOWS:
            raise ValueError(f"step_windows must be one of {STEP_WINDOWS}, got {choice!r}")
        if choice == "auto":
            config = self.model.config  # a VQ memory (no k) has one window already
            own = config.memory != "vq" and reads_own_length(config, self.model.kernels, self.state.memory.k.dtype)
            choice = "one" if own else "windows"
        return (self.max_len,) if choice == "one" else self.windows

    def spec_counts(self) -> None:
        """A plain engine does not speculate."""
        return None

    def reset(self) -> None:
        """Fresh, empty decode state (all slots free)."""
        config = self.model.config
        self._new_pool()
        # Made by a jitted function straight into its shardings: no host or single-device copy of the
        # memory, and valid when the mesh spans hosts (each host makes only its own shards).
        make = jax.jit(
            lambda: DecodeState(
                self._empty_memory(config),
                jnp.zeros((self.slots,), jnp.int32),
                jax.tree_util.tree_map(jnp.asarray, make_settings([SamplingParams()] * self.slots, config.vocab_size)),
                empty_history(self.slots, config.vocab_size),
            ),
            out_shardings=self.state_shardings,
        )
        self.state = make()
        self.positions = np.zeros(self.slots, np.int64)  # host mirror of memory.step

    def _sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    # -- compiled bodies ------------------------------------------------------------------------
    def _fill(self, attend_len, params, state: DecodeState, tokens, length, slot, generated_from, last_only: bool):
        """tokens [1, T] (one chunk of one prompt) into slot [1]; attend_len 0 starts the slot afresh.
        The chunk's tokens from index generated_from [1] on were generated by the request (a preempted one
        resuming): counted for the penalties as a decode step counts them, not as prompt tokens.
        Returns the logits ([1, V] of the last real token if last_only, else [1, T, V]) and the state."""
        memory, history = state.memory, state.history
        vocab = self.model.config.vocab_size
        t_idx = jnp.arange(tokens.shape[1])
        real, prompt = t_idx < length[0], t_idx < generated_from[0]
        seen = jnp.zeros((vocab,), bool).at[jnp.where(real & prompt, tokens[0], vocab)].set(True, mode="drop")
        made = jnp.zeros((1, vocab), jnp.int32).at[0, jnp.where(real & ~prompt, tokens[0], vocab)].add(1, mode="drop")
        if attend_len == 0:
            memory = reset_slot(memory, slot[0])
            history = TokenHistory(history.counts.at[slot].set(made), history.in_prompt.at[slot].set(seen))
        else:
            in_prompt = history.in_prompt.at[slot].set(history.in_prompt[slot] | seen)
            history = TokenHistory(history.counts.at[slot].add(made), in_prompt)
        logits, memory = self.model.forward(params, tokens, memory, length, slot, attend_len, last_only)
        return logits, state._replace(memory=memory, history=history)

    def _sample_first(self, state: DecodeState, logits, slot, row_settings, row_mask):
        """Sample the slot's first token from its last prompt token's logits [1, V], among the tokens
        row_mask [1, W] allows (all of them unless a grammar constrains the request)."""
        row_history = TokenHistory(state.history.counts[slot], state.history.in_prompt[slot])
        out = sample(logits, row_settings, state.memory.step[slot], self.n_top, row_history, row_mask)
        settings = jax.tree_util.tree_map(lambda all_, row: all_.at[slot].set(row), state.settings, row_settings)
        return state._replace(tokens=state.tokens.at[slot].set(out.token), settings=settings), pack(out)

    def _prefill_impl(
        self, attend_len, params, state: DecodeState, tokens, length, slot, generated_from, row_settings, row_mask
    ):
        logits, state = self._fill(attend_len, params, state, tokens, length, slot, generated_from, True)
        return self._sample_first(state, logits, slot, row_settings, row_mask)

    def _score_impl(
        self, attend_len, params, state: DecodeState, tokens, length, slot, gen_from, row_settings, row_mask, targets
    ):
        """_prefill_impl that also scores targets [1, T] (each position's next prompt token) under the
        logits of every position: the one program that computes the head over the whole chunk."""
        logits, state = self._fill(attend_len, params, state, tokens, length, slot, gen_from, False)  # [1, T, V]
        last = jnp.take(logits[0], jnp.maximum(length - 1, 0), axis=0)  # [1, V]
        state, packed = self._sample_first(state, last, slot, row_settings, row_mask)
        return state, packed, score_targets(logits[0], targets[0], self.n_top)

    def _step_impl(self, attend_len, params, state: DecodeState, active, bitmask=None):
        """One token for every active slot ([B] bool); idle slots compute but write nothing. With a
        bitmask [B, W]: a constrained step in one program, once its masks are known."""
        state, logits = self._forward_impl(attend_len, params, state, active)
        return self._sample_impl(state, logits, active, bitmask)

    def _forward_impl(self, attend_len, params, state: DecodeState, active):
        """The model half of a step → (state, logits [B, V] of the next token)."""
        lengths = active.astype(jnp.int32)
        rows = jnp.arange(self.slots)
        # The input token was generated by the previous call: count it for the penalties now.
        history = state.history._replace(counts=state.history.counts.at[rows, state.tokens].add(lengths))
        logits, memory = self.model.forward(params, state.tokens[:, None], state.memory, lengths, None, attend_len)
        return state._replace(memory=memory, history=history), logits[:, 0]

    def _sample_impl(self, state: DecodeState, logits, active, bitmask):
        """The sampling half of a step, among the tokens bitmask [B, W] allows (None: all)."""
        out = sample(logits, state.settings, state.memory.step, self.n_top, state.history, bitmask, self.model.kernels)
        return state._replace(tokens=jnp.where(active, out.token, state.tokens)), pack(out)

    def _compiled_fn(self, kind: str, attend_len: int) -> Program:
        """The program of `kind` at this window, compiled ahead of time on first use (programs.py): jit
        with explicit shardings; static attend_len is bound by partial (jit with in_shardings takes no
        keyword arguments)."""
        key = (kind, attend_len)
        program = self._compiled.get(key)
        if program is None:  # two threads may both make one: the same name, so the same executables
            fn, in_sh, out_sh, state_at = self._program_parts(kind, attend_len)
            params_spec, state_spec = self._specs
            fixed = {state_at: state_spec} if state_at == 0 else {0: params_spec, 1: state_spec}
            jit_options = dict(in_shardings=in_sh, out_shardings=out_sh, donate_argnums=(state_at,))
            program = self._compiled[key] = Program(self.programs, key, fn, fixed, **jit_options)
        return program

    def _program_parts(self, kind: str, attend_len: int):
        """(function, in_shardings, out_shardings, position of the donated state) of a program."""
        rep = self._sharding()
        if kind == "prefill":
            fn = functools.partial(self._prefill_impl, attend_len)
            return fn, (self.param_shardings, self.state_shardings, *[rep] * 6), (self.state_shardings, rep), 1
        if kind == "score":
            fn = functools.partial(self._score_impl, attend_len)
            return fn, (self.param_shardings, self.state_shardings, *[rep] * 7), (self.state_shardings, rep, rep), 1
        if kind == "forward":  # a constrained step's halves: the host fills masks between them
            fn = functools.partial(self._forward_impl, attend_len)
            out_sh = (self.state_shardings, self._sharding("data", None))
            return fn, (self.param_shardings, self.state_shardings, rep), out_sh, 1
        if kind == "masked":
            fn = functools.partial(self._step_impl, attend_len)
            return fn, (self.param_shardings, self.state_shardings, rep, rep), (self.state_shardings, rep), 1
        if kind == "sample":
            in_sh = (self.state_shardings, self._sharding("data", None), rep, rep)
            return self._sample_impl, in_sh, (self.state_shardings, rep), 0
        if kind == "table":  # the host's block table into the (donated) state
            # Passed replicated, like `active`: a host's numpy array may only enter a program that
            # spans hosts replicated (every host passes the same table); the program slices it.
            return set_table, (self.state_shardings, rep), self.state_shardings, 0
        if kind == "copy":
            return copy_prefix, (self.state_shardings, *[rep] * 5), self.state_shardings, 0
        # "step": `active` and the sampled tokens are replicated: tiny, and every host can then pass
        # and read them even when the slots' rows live on other hosts.
        fn = functools.partial(self._step_impl, attend_len)
        return fn, (self.param_shardings, self.state_shardings, rep), (self.state_shardings, rep), 1

    # -- host API -------------------------------------------------------------------------------
    def _window(self, needed: int) -> int:
        return self.windows[bisect.bisect_left(self.windows, needed)]

    def check_fits(self, prompt_len: int, max_tokens: int = 0) -> None:
        check_context(self.max_len, prompt_len, max_tokens)

    def rows_program(self, prompt_len: int) -> tuple[int, int] | None:
        """(bucket, rows) of the batched prefill program that takes a prompt of this length, or None."""
        return self.row_prefill.program_for(prompt_len)

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], settings) -> PendingTokens:
        """Prompts that fit one bucket, each into its slot, in one call of that bucket's rows program
        (see prefill_rows.py) → row i: prompt i's first token. Fails as `prefill` does."""
        with self._guarded():
            return PendingTokens(self.row_prefill.prefill(slots, prompts, settings))

    def _copy_prefix(self, source: int, dest: int, prefix: Sequence[int], source_row: np.ndarray | None = None) -> None:
        """Slot dest starts with slot source's KV of `prefix` (one program per window of rows). Paged:
        `source_row` [MB] is the source's block table row before `_assign` (None: as it is now); only
        the blocks dest does not share with it are copied."""
        window = self._window(len(prefix))
        args = self._copy_args(source, dest, prefix, window, source_row)
        self.sync_table()
        self.state = self._compiled_fn("copy", window)(self.state, *args)
        self.positions[dest] = len(prefix)

    def _copy_args(self, source: int, dest: int, prefix: Sequence[int], window: int, source_row) -> tuple:
        """The copy program's host arguments (after the state)."""
        tokens = np.zeros((window,), np.int32)
        tokens[: len(prefix)] = prefix
        if source_row is None:
            source_row = self.kv_pool.table[source].copy() if self.kv_pool is not None else np.zeros(1, np.int32)
        return (
            tokens,
            np.asarray([source], np.int32),
            np.asarray([dest], np.int32),
            np.asarray([len(prefix)], np.int32),
            source_row,
        )

    def _step_window(self, active: np.ndarray) -> int:
        """The step-like programs' window for these rows: the smallest of `step_windows` that holds them."""
        needed = int(self.positions[active].max()) if active.any() else 1
        if needed >= self.max_len:
            raise ContextLengthError(self.max_len, needed, 1)
        return self.step_windows[bisect.bisect_left(self.step_windows, max(needed, 1))]

    def step(self, active: np.ndarray) -> PendingTokens:
        """Decode one token for each slot where `active` [B] is true (B rows; idle rows are junk)."""
        active = np.asarray(active, bool)
        self._grow(active)
        self.state, out = self._compiled_fn("step", self._step_window(active))(self.params, self.state, active)
        self.positions += active
        return PendingTokens(out)

    def step_forward(self, active: np.ndarray) -> PendingLogits:
        """`step` in two calls, for steps with grammar-constrained rows: this one dispatches the model
        (the host fills the masks meanwhile), `step_sample` then samples under the masks. With
        `split_masks` off it dispatches nothing, and `step_sample` runs the whole step at once."""
        active = np.asarray(active, bool)
        window = self._step_window(active)
        self._grow(active)
        self.positions += active
        if not self.split_masks:
            return PendingLogits(None, active, window)
        self.state, logits = self._compiled_fn("forward", window)(self.params, self.state, active)
        return PendingLogits(logits, active)

    def step_sample(self, forward: PendingLogits, bitmask: np.ndarray) -> PendingTokens:
        """Sample the step that `step_forward` began, among the tokens bitmask [B, W] int32 allows."""
        if forward.logits is None:
            fn = self._compiled_fn("masked", forward.window)
            self.state, out = fn(self.params, self.state, forward.active, bitmask)
        else:
            self.state, out = self._compiled_fn("sample", 0)(self.state, forward.logits, forward.active, bitmask)
        return PendingTokens(out)
