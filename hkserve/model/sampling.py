"""Per-row token sampling on the device: every setting is an array over slots, so one compiled
function serves a batch whose requests all sample differently.

Randomness is keyed by (request seed, token position), never by batch layout: a seeded request
draws the same tokens alone or among others.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import ffi
from hkserve.kernels.dispatch import KernelSpec

NEG_INF = -jnp.inf
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_REPETITION_PENALTY = 1e6  # far past any useful value, well inside float32


class SampleSettings(NamedTuple):
    temperature: jax.Array  # [B] float32; 0 = greedy
    top_p: jax.Array  # [B] float32; 1 = off
    top_k: jax.Array  # [B] int32; 0 = off
    min_p: jax.Array  # [B] float32; 0 = off
    presence_penalty: jax.Array  # [B] float32; subtracted once from every generated token's logit
    frequency_penalty: jax.Array  # [B] float32; subtracted per occurrence in the generated text
    repetition_penalty: jax.Array  # [B] float32; 1 = off; divides (or multiplies, if negative) logits of
    #                                tokens seen in prompt or output (CTRL / Hugging Face semantics)
    seed: jax.Array  # [B] uint32
    logit_bias: jax.Array  # [B, V] float32 added to the logits (-100 bans a token, +100 forces it)


class TokenHistory(NamedTuple):
    """What the penalties look at, per slot."""

    counts: jax.Array  # [B, V] int32: occurrences of each token in the generated text
    in_prompt: jax.Array  # [B, V] bool: token occurs in the prompt


class SampleOutput(NamedTuple):
    token: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, under the model's distribution (log_softmax of raw logits)
    top_ids: jax.Array  # [B, K] int32, most likely tokens
    top_logprobs: jax.Array  # [B, K] float32


class InvalidSampling(ValueError):
    """A sampling parameter the device cannot honour; `param` names it (the HTTP layer reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, from the request's edge down to the device row.

    Defined and validated once: a value the device's arrays cannot hold (a top_k past int32, a seed
    past uint32, a NaN) is refused here, as InvalidSampling (a ValueError), before it is queued."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off (-1, as in vLLM, is taken as 0)
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias; JSON's string ids are read

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidSampling(name, f"{name} must be a number, got {value!r}")
            if not (lo < value if lo_open else lo <= value) or not value <= hi:
                lower = f"greater than {lo}" if lo_open else f"at least {lo}"
                raise InvalidSampling(name, f"{name} must be {lower} and at most {hi}, got {value}")
            return float(value)

        def integer(name: str, lo: int, hi: int) -> int:
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidSampling(name, f"{name} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise InvalidSampling(name, f"{name} must be in [{lo}, {hi}], got {value}")
            return value

        set_ = functools.partial(object.__setattr__, self)
        set_("temperature", number("temperature", 0.0, 100.0))
        set_("top_p", number("top_p", 0.0, 1.0, lo_open=True))
        set_("top_k", max(integer("top_k", -1, INT32_MAX), 0))
        set_("min_p", number("min_p", 0.0, 1.0))
        set_("presence_penalty", number("presence_penalty", -2.0, 2.0))
        set_("frequency_penalty", number("frequency_penalty", -2.0, 2.0))
        set_("repetition_penalty", number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True))
        set_("seed", integer("seed", 0, UINT32_MAX))
        set_("logit_bias", _logit_bias(self.logit_bias))

    def with_overrides(self, values: Mapping[str, Any]) -> SamplingParams:
        """These settings, with each field that `values` (a request body, a JSONL line) gives, not None."""
        given = {f.name: values[f.name] for f in fields(self) if values.get(f.name) is not None}
        return replace(self, **given)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidSampling(
                "logit_bias", f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
            )


_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only ("²".isdigit() is true), and short enough for int()


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise InvalidSampling("logit_bias", f"logit_bias must map token ids to biases, got {bias!r}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int):
            shown = key if not isinstance(key, str) or len(key) <= 24 else key[:24] + "..."
            raise InvalidSampling("logit_bias", f"logit_bias keys must be token ids, got {shown!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidSampling("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r}")
        out[key] = float(value)
    return out


def make_settings(rows: Sequence[SamplingParams], vocab_size: int) -> SampleSettings:
    """Host-side constructor: one row per request (empty slots take SamplingParams())."""

    def col(name, dtype):
        return np.asarray([getattr(r, name) for r in rows], dtype)

    bias = np.zeros((len(rows), vocab_size), np.float32)
    for i, r in enumerate(rows):
        r.check_vocab(vocab_size)
        for token, value in r.logit_bias.items():
            bias[i, token] = value
    return SampleSettings(
        temperature=col("temperature", np.float32),
        top_p=col("top_p", np.float32),
        top_k=col("top_k", np.int32),
        min_p=col("min_p", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        seed=col("seed", np.uint32),
        logit_bias=bias,
    )


def empty_history(batch: int, vocab_size: int) -> TokenHistory:
    return TokenHistory(jnp.zeros((batch, vocab_size), jnp.int32), jnp.zeros((batch, vocab_size), bool))


def adjust_logits(logits: jax.Array, settings: SampleSettings, history: TokenHistory | None) -> jax.Array:
    """Bias, then repetition / frequency / presence penalties. [B, V] → [B, V]

    The penalties run only when some row has one (at 16 slots of SmolLM2 they were 2.9 ms of a 20 ms CPU
    step, and again inside the argmax that fused them); for a row without, they change no bit."""
    logits = logits + settings.logit_bias
    if history is None:
        return logits
    return jax.lax.cond(_any_penalty(settings), lambda: _penalize(logits, settings, history), lambda: logits)


def _any_penalty(settings: SampleSettings) -> jax.Array:
    """Whether some row has a repetition, frequency or presence penalty. → [] bool"""
    penalized = settings.repetition_penalty != 1
    return jnp.any(penalized | (settings.frequency_penalty != 0) | (settings.presence_penalty != 0))


def _penalize(logits: jax.Array, settings: SampleSettings, history: TokenHistory) -> jax.Array:
    seen = history.in_prompt | (history.counts > 0)
    rep = settings.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = history.counts.astype(jnp.float32)
    logits = logits - settings.frequency_penalty[:, None] * counts
    return logits - settings.presence_penalty[:, None] * (counts > 0)


TOP_CHUNK = 256  # top_k's chunk: the logit-stats kernel reads its maxima in the pass it makes anyway


def top_k(x: jax.Array, k: int, chunk: int = TOP_CHUNK, maxima: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis, ties included (the lower index first), in two stages: the k chunks
    of `chunk` values with the largest maxima hold the k largest values, so top_k runs over the chunk
    maxima and then over those k chunks only. XLA's CPU TopK over [16, 49152] took 0.83 ms (k 5) and
    0.88 ms (k 20); this 0.11 and 0.24. maxima: the chunk maxima [B, ceil(V / chunk)] where a kernel
    already read them (ffi.logit_stats), else XLA reduces x. → (values [B, k], ids [B, k] int32)"""
    b, v = x.shape
    n_chunks = -(-v // chunk)
    if n_chunks < 4 * k:  # small vocabularies: nothing to gain
        return jax.lax.top_k(x, k)
    chunks = jnp.pad(x, ((0, 0), (0, n_chunks * chunk - v)), constant_values=-jnp.inf).reshape(b, n_chunks, chunk)
    maxima = chunks.max(-1) if maxima is None else maxima  # [B, n_chunks]
    _, best = jax.lax.top_k(maxima, k)  # [B, k] chunks, the lower index first among equal maxima
    best = jnp.sort(best, axis=-1)  # candidates in index order, so equal values keep top_k's order
    candidates = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(b, k * chunk)  # [B, k*chunk]
    values, at = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best, at // chunk, axis=-1) * chunk + at % chunk
    return values, ids.astype(jnp.int32)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value) as two plain reductions, a max
    and a min over indices, which XLA's CPU backend vectorizes; its (value, index) reduction of argmax took
    1.8 ms over [16, 49152]. A row with a NaN gives its last index where XLA's max returns the NaN (on
    the CPU at 17 and 1000 values; at 49152 its reduction skipped the NaN and the largest other value
    won; kernels/logits.cc always gives the last index). [B, V] → [B] int32"""
    v = x.shape[-1]
    ids = jnp.where(x == jnp.max(x, axis=-1, keepdims=True), jnp.arange(v, dtype=jnp.int32), v)
    return jnp.minimum(jnp.min(ids, axis=-1), v - 1)


def _largest_threshold(x: jax.Array, holds, iters: int = 32) -> jax.Array:
    """Per row of x [B, V], the (nearly) largest t with holds(t) true, where holds is monotone
    (true at the row's smallest finite value, false above the maximum). Bisection: [B, V] passes, no
    vocabulary sort. Masked entries (-inf: logit_bias bans, grammar masks) are outside the search, which
    would otherwise never leave -inf."""
    lo, hi = jnp.where(jnp.isfinite(x), x, jnp.inf).min(axis=-1), x.max(axis=-1) + 1e-6

    def step(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, iters, step, (lo, hi))[0]


def _filter(scaled: jax.Array, top_p, top_k, min_p) -> jax.Array:
    """top-k, then top-p on the renormalised rest, then min-p masks on temperature-scaled logits
    [B, V] (masked → -inf). Thresholds come from bisection instead of sorting the vocabulary, which
    costs ~20x more on a CPU; a neutral setting (top_k 0, top_p 1, min_p 0) masks nothing."""
    kth = _largest_threshold(scaled, lambda t: (scaled >= t[:, None]).sum(-1) >= top_k)
    keep = (top_k[:, None] <= 0) | (scaled >= kth[:, None])
    probs = jax.nn.softmax(jnp.where(keep, scaled, NEG_INF), axis=-1)
    nucleus = _largest_threshold(probs, lambda t: jnp.where(probs >= t[:, None], probs, 0.0).sum(-1) >= top_p)
    keep &= (top_p[:, None] >= 1.0) | (probs >= nucleus[:, None])
    keep &= probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(keep, scaled, NEG_INF)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Disallowed tokens → -inf. logits [B, V]; bitmask [B, ceil(V/32)] int32, bit j of word w allows
    token 32w + j (llguidance's layout)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]].astype(bool)
    return jnp.where(allowed, logits, NEG_INF)


def sample(
    logits: jax.Array,
    settings: SampleSettings,
    positions: jax.Array,
    n_top: int = 0,
    history: TokenHistory | None = None,
    bitmask: jax.Array | None = None,
    kernels: KernelSpec | None = None,
) -> SampleOutput:
    """logits: [B, V] float32; positions: [B] position the sampled token will take (keys the RNG);
    bitmask: [B, ceil(V/32)] int32 allowed tokens (a grammar's), applied before everything else;
    kernels: the CPU kernels' spec (kernels/dispatch.py), whose logit_stats then reads the rows (a quantized
    model's; a float model's attention-only spec leaves sampling as XLA's, as it was).

    Reported logprobs are those of the model (log_softmax of the raw logits); the token is drawn
    after the mask, bias and penalties."""
    raw = logits.astype(jnp.float32)
    # log_softmax's terms, read only where a logprob is reported (the chosen and the top tokens), so no
    # [B, V] array of logprobs is written: (x - max) - log(sum(exp(x - max))), as jax.nn.log_softmax.
    if kernels is not None and not kernels.attention_only and bitmask is None:
        # One multi-threaded kernel reads each row for these terms and the greedy token of the biased
        # logits; the biased (and penalized) [B, V] array is then made only inside the branches that
        # need it (penalties, sampling). At 16 slots of SmolLM2 XLA's five passes over [B, V], each on one
        # thread, took ~1.2 ms of a 14.6 ms CPU step; the kernel 0.3 ms.
        stats = ffi.logit_stats(raw, settings.logit_bias, kernels.threads, TOP_CHUNK)
        row_max, log_total, biased_greedy, maxima = stats  # [B] x 3, [B, ceil(V / TOP_CHUNK)]

        def adjusted():
            return adjust_logits(raw, settings, history)

        greedy = biased_greedy
        if history is not None:
            greedy = jax.lax.cond(_any_penalty(settings), lambda: first_argmax(adjusted()), lambda: biased_greedy)
    else:
        row_max, maxima = jnp.max(raw, axis=-1), None  # [B]
        log_total = jnp.log(jnp.sum(jnp.exp(raw - row_max[:, None]), axis=-1))  # [B]
        logits = adjust_logits(raw if bitmask is None else apply_bitmask(raw, bitmask), settings, history)
        greedy = first_argmax(logits)

        def adjusted():
            return logits

    def logprob_of(values):  # raw logits [B, K] → their logprobs
        return (values - row_max[:, None]) - log_total[:, None]

    sampling = settings.temperature > 0
    filtered = (settings.top_k > 0) | (settings.top_p < 1.0) | (settings.min_p > 0)

    def draw_all():
        # Each stage runs only when some row needs it; for rows that do not, it changes nothing. The
        # temperature too: dividing [B, V] by it was 0.22 ms of a 15 ms 16-slot CPU step of greedy rows.
        scaled = adjusted() / jnp.maximum(settings.temperature, 1e-6)[:, None]
        scaled = jax.lax.cond(
            jnp.any(sampling & filtered),
            lambda: _filter(scaled, settings.top_p, settings.top_k, settings.min_p),
            lambda: scaled,
        )
        # Inverse-CDF sampling: one uniform per row (a Gumbel draw would need V random numbers per row,
        # and generating those dominated the CPU step time).
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.PRNGKey(seed), pos))(settings.seed, positions)
        u = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]
        cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)  # [B, V]
        # The count is at most V - 1: the last entry is the total itself, never below u * total (u <= 1).
        sampled = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
        return jnp.where(sampling, sampled, greedy)

    token = jax.lax.cond(jnp.any(sampling), draw_all, lambda: greedy)
    chosen = logprob_of(jnp.take_along_axis(raw, token[:, None], axis=-1))[:, 0]
    if n_top:
        top_values, top_ids = top_k(raw, n_top, TOP_CHUNK, maxima)
        top_logprobs = logprob_of(top_values)
    else:
        top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    return SampleOutput(token, chosen, top_ids.astype(jnp.int32), top_logprobs)
