"""The device side of serving (JetStream's "engine"): compiled prefill-into-slot and one decode step
for all slots over a batched KV memory. No threads, no requests: whoever owns the engine calls it.

Shapes are fixed so compiles are few: prompts are padded to a prefill bucket, and the decode step reads
the past through an attention window chosen from a few sizes by the longest active slot (tracked on the
host, so choosing it needs no device sync). The decode state is donated to each call: the KV memory is
updated in place.
"""

from __future__ import annotations

import bisect
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.memory import KVMemory, init_memory
from model.sampling import SampleOutput, SampleSettings, make_settings, sample
from model.transformer import Model

DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


class ContextLengthError(ValueError):
    """A request that cannot fit a slot's context; the message carries both numbers."""


class DecodeState(NamedTuple):
    memory: KVMemory
    tokens: jax.Array  # [B] int32: each slot's last sampled token, the input of the next step
    settings: SampleSettings  # [B] per-slot sampling settings


def window_sizes(max_len: int, smallest: int = 128) -> tuple[int, ...]:
    """Attention windows: powers of two from `smallest`, capped by (and always including) max_len."""
    sizes, w = [], smallest
    while w < max_len:
        sizes.append(w)
        w *= 2
    return tuple(sizes) + (max_len,)


class Engine:
    def __init__(self, model: Model, params, slots: int = 1, max_len: int = 2048,
                 prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS, n_top: int = 5):
        if max_len > model.config.context_length:
            max_len = model.config.context_length
        self.model, self.params, self.slots, self.max_len, self.n_top = model, params, slots, max_len, n_top
        self.prefill_buckets = tuple(sorted(b for b in prefill_buckets if b <= max_len)) or (max_len,)
        self.windows = window_sizes(max_len, min(128, max_len))
        self.positions = np.zeros(slots, np.int64)  # host mirror of memory.step
        self.state = DecodeState(
            memory=init_memory(model.config, slots, max_len),
            tokens=jnp.zeros((slots,), jnp.int32),
            settings=jax.tree_util.tree_map(jnp.asarray, make_settings([{}] * slots)),
        )
        self._prefill = jax.jit(self._prefill_impl, static_argnums=(6,), donate_argnums=(1,))
        self._step = jax.jit(self._step_impl, static_argnums=(3,), donate_argnums=(1,))

    # -- compiled bodies ------------------------------------------------------------------------
    def _prefill_impl(self, params, state: DecodeState, tokens, length, slot, row_settings, attend_len):
        """tokens [1, T] (one chunk of one prompt) into slot [1]; attend_len 0 starts the slot afresh."""
        memory = state.memory
        if attend_len == 0:
            memory = memory._replace(step=memory.step.at[slot].set(0))
        logits, memory = self.model.forward(params, tokens, memory, length, slot, attend_len, True)
        out = sample(logits, row_settings, memory.step[slot], self.n_top)
        settings = jax.tree_util.tree_map(lambda all_, row: all_.at[slot].set(row), state.settings, row_settings)
        return DecodeState(memory, state.tokens.at[slot].set(out.token), settings), out

    def _step_impl(self, params, state: DecodeState, active, attend_len):
        """One token for every active slot ([B] bool); idle slots compute but write nothing."""
        lengths = active.astype(jnp.int32)
        logits, memory = self.model.forward(params, state.tokens[:, None], state.memory, lengths, None, attend_len)
        out = sample(logits[:, 0], state.settings, memory.step, self.n_top)
        tokens = jnp.where(active, out.token, state.tokens)
        return DecodeState(memory, tokens, state.settings), out

    # -- host API -------------------------------------------------------------------------------
    def _window(self, needed: int) -> int:
        return self.windows[bisect.bisect_left(self.windows, needed)]

    def check_fits(self, prompt_len: int, max_tokens: int = 0) -> None:
        if prompt_len + max_tokens > self.max_len:
            raise ContextLengthError(
                f"this model's context is {self.max_len} tokens; the request needs {prompt_len + max_tokens} "
                f"({prompt_len} in the prompt, {max_tokens} to generate)")
        if prompt_len == 0:
            raise ValueError("the prompt is empty")

    def prefill(self, slot: int, prompt_ids: Sequence[int], settings: dict | None = None) -> SampleOutput:
        """Fill slot `slot` with the prompt (in chunks of the largest bucket) and sample its first token.
        Returns the sample as device arrays of batch 1."""
        self.check_fits(len(prompt_ids))
        row = jax.tree_util.tree_map(jnp.asarray, make_settings([settings or {}]))
        chunk = self.prefill_buckets[-1]
        slot_arr = jnp.asarray([slot], jnp.int32)
        for start in range(0, len(prompt_ids), chunk):
            piece = list(prompt_ids[start:start + chunk])
            bucket = self.prefill_buckets[bisect.bisect_left(self.prefill_buckets, len(piece))]
            tokens = np.zeros((1, bucket), np.int32)
            tokens[0, :len(piece)] = piece
            attend_len = 0 if start == 0 else self._window(start)
            self.state, out = self._prefill(self.params, self.state, tokens, np.asarray([len(piece)], np.int32),
                                            slot_arr, row, attend_len)
        self.positions[slot] = len(prompt_ids)
        return out

    def step(self, active: np.ndarray) -> SampleOutput:
        """Decode one token for each slot where `active` [B] is true. Returns device arrays [B]."""
        active = np.asarray(active, bool)
        needed = int(self.positions[active].max()) if active.any() else 1
        if needed >= self.max_len:
            raise ContextLengthError(f"a slot reached the context length {self.max_len}")
        self.state, out = self._step(self.params, self.state, active, self._window(max(needed, 1)))
        self.positions += active
        return out

    def warmup(self) -> None:
        """Compile every prefill bucket and decode window now, not on the first request."""
        for bucket in self.prefill_buckets:
            self.prefill(0, [0] * bucket)
        for w in self.windows:
            self.positions[0] = w - 1
            jax.block_until_ready(self.step(np.eye(self.slots, dtype=bool)[0]))
        self.positions[:] = 0


class Token(NamedTuple):
    """One generated token as the host sees it."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


def _host_row(out: SampleOutput, row: int) -> Token:
    return Token(int(out.token[row]), float(out.logprob[row]),
                 list(zip(np.asarray(out.top_ids[row]).tolist(), np.asarray(out.top_logprobs[row]).tolist())))


def generate(engine: Engine, prompt_ids: Sequence[int], max_tokens: int, settings: dict | None = None,
             stop_ids: Sequence[int] = (), slot: int = 0) -> Iterator[Token]:
    """One request in one slot: prefill once, then one token per step until a stop id or max_tokens.

    The next step is dispatched before the previous token is read, so the device never waits for
    Python; at most one step is computed past the end and discarded.
    """
    engine.check_fits(len(prompt_ids), max_tokens)
    active = np.zeros(engine.slots, bool)
    active[slot] = True
    out, row = engine.prefill(slot, prompt_ids, settings), 0
    for produced in range(1, max_tokens + 1):
        for leaf in out:
            leaf.copy_to_host_async()
        following = engine.step(active) if produced < max_tokens else None
        token = _host_row(out, row)
        yield token
        if token.id in stop_ids:
            return
        out, row = following, slot
