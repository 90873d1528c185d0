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
    seed: jax.Array  # [B] uint32


class SampleOutput(NamedTuple):
    token: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, under the model's distribution (log_softmax of raw logits)
    top_ids: jax.Array  # [B, K] int32, most likely tokens
    top_logprobs: jax.Array  # [B, K] float32


def make_settings(rows: Sequence[dict]) -> SampleSettings:
    """Host-side constructor: one dict per row with any of temperature/top_p/top_k/min_p/seed."""

    def col(name, default, dtype):
        return np.asarray([r.get(name, default) if r.get(name) is not None else default for r in rows], dtype)

    return SampleSettings(
        temperature=col("temperature", 0.0, np.float32),
        top_p=col("top_p", 1.0, np.float32),
        top_k=col("top_k", 0, np.int32),
        min_p=col("min_p", 0.0, np.float32),
        seed=col("seed", 0, np.uint32),
    )


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


def sample(logits: jax.Array, settings: SampleSettings, positions: jax.Array, n_top: int = 0) -> SampleOutput:
    """logits: [B, V] float32; positions: [B] position the sampled token will take (keys the RNG)."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
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
