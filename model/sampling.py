"""Per-row token sampling on the device: every setting is an array over slots, so one compiled
function serves a batch whose requests all sample differently.

Randomness is keyed by (request seed, token position), never by batch layout: a seeded request
draws the same tokens alone or among others.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


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


DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 0}


def make_settings(rows: Sequence[dict], vocab_size: int) -> SampleSettings:
    """Host-side constructor: one dict per row with any of the fields above; `logit_bias` is a
    {token_id: bias} dict. Missing or None fields take their neutral value."""

    def col(name, dtype):
        return np.asarray([DEFAULTS[name] if r.get(name) is None else r[name] for r in rows], dtype)

    bias = np.zeros((len(rows), vocab_size), np.float32)
    for i, r in enumerate(rows):
        for token, value in (r.get("logit_bias") or {}).items():
            token = int(token)
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})")
            bias[i, token] = float(value)
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
    """Bias, then repetition / frequency / presence penalties. [B, V] → [B, V]"""
    logits = logits + settings.logit_bias
    if history is None:
        return logits
    seen = history.in_prompt | (history.counts > 0)
    rep = settings.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = history.counts.astype(jnp.float32)
    logits = logits - settings.frequency_penalty[:, None] * counts
    return logits - settings.presence_penalty[:, None] * (counts > 0)


def _filter_row(logits: jax.Array, temperature, top_p, top_k, min_p) -> jax.Array:
    """Temperature, then top-k, top-p and min-p masks on one row [V] (masked entries → -inf)."""
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(scaled.shape[0])
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, NEG_INF))
    before = jnp.cumsum(probs) - probs  # mass of strictly more likely tokens
    keep &= before < top_p  # the most likely token always survives (before = 0)
    keep &= probs >= min_p * probs[0]
    masked_sorted = jnp.where(keep, sorted_logits, NEG_INF)
    return jnp.zeros_like(scaled).at[order].set(masked_sorted)


def sample(logits: jax.Array, settings: SampleSettings, positions: jax.Array, n_top: int = 0,
           history: TokenHistory | None = None) -> SampleOutput:
    """logits: [B, V] float32; positions: [B] position the sampled token will take (keys the RNG).

    Reported logprobs are those of the model (log_softmax of the raw logits); the token is drawn
    after bias and penalties."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logits = adjust_logits(logits.astype(jnp.float32), settings, history)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(row_logits, t, p, k, m, seed, pos):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), pos)
        return jax.random.categorical(key, _filter_row(row_logits, t, p, k, m)).astype(jnp.int32)

    def draw_all():
        sampled = jax.vmap(draw)(logits, settings.temperature, settings.top_p, settings.top_k, settings.min_p,
                                 settings.seed, positions)
        return jnp.where(settings.temperature > 0, sampled, greedy)

    # An all-greedy batch skips the per-row vocabulary sort entirely.
    token = jax.lax.cond(jnp.any(settings.temperature > 0), draw_all, lambda: greedy)
    chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    if n_top:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, n_top)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(token, chosen, top_ids.astype(jnp.int32), top_logprobs)
