"""What the engine's calls return: sampled and scored tokens packed into one float32 array on the
device (one device-to-host copy each), and the host-side readers of those arrays."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.model.sampling import SampleOutput


class PendingLogits(NamedTuple):
    """The first half of a split step: its logits, still on the device; or, where the engine fuses
    the halves (Engine.split_masks false), no logits yet: the step's window, run once the masks come."""

    logits: jax.Array | None  # [B, V]
    active: np.ndarray  # [B] bool
    window: int = 0  # the attention window of a fused step


class Token(NamedTuple):
    """One sampled token as the host sees it."""

    id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely alternatives (id, logprob), best first


class ScoredToken(NamedTuple):
    """One prompt token scored under the model given the tokens before it."""

    id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely tokens at its position (id, logprob), best first
    rank: int  # 1 + how many tokens were more likely


def score_targets(logits: jax.Array, targets: jax.Array, k: int) -> jax.Array:
    """Log-softmax of logits [T, V] at targets [T]: [T, 3 + 2k] float32 rows of (target id, its
    logprob, its rank, k top ids, k top logprobs), one array for one device→host copy."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [T, 1]
    rank = 1 + jnp.sum(logprobs > chosen, axis=-1, keepdims=True)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
    f32 = jnp.float32
    return jnp.concatenate(
        [targets.astype(f32)[:, None], chosen, rank.astype(f32), top_ids.astype(f32), top_logprobs], axis=-1
    )


def pack(out: SampleOutput) -> jax.Array:
    """All of a sample in one float32 array [B, 2 + 2K], so one device→host copy carries it.
    Token ids are exact in float32 below 2**24."""
    f32 = jnp.float32
    return jnp.concatenate(
        [out.token.astype(f32)[:, None], out.logprob[:, None], out.top_ids.astype(f32), out.top_logprobs], axis=-1
    )


class PendingTokens:
    """A prefill's or step's sampled tokens on the device, with the host copy already started:
    `read()` later costs no device wait if the step has finished."""

    def __init__(self, packed: jax.Array):
        self.packed = packed
        packed.copy_to_host_async()

    def read(self) -> list[Token]:
        host = np.asarray(self.packed)
        k = (host.shape[1] - 2) // 2
        ids = host[:, 2 : 2 + k].astype(np.int64).tolist()
        lps = host[:, 2 + k :].tolist()
        return [Token(int(row[0]), float(row[1]), list(zip(i, lp))) for row, i, lp in zip(host, ids, lps)]


class PendingScores:
    """A scoring prefill's per-chunk scores on the device, host copies started (see PendingTokens)."""

    def __init__(self, chunks: list[tuple[jax.Array, int]]):
        self.chunks = chunks  # (scores [T, 3 + 2K], real positions) per prefill chunk
        for scores, _ in chunks:
            scores.copy_to_host_async()

    def read(self) -> list[ScoredToken]:
        """Prompt tokens 1.. scored (the first has nothing before it to be scored on)."""
        host = np.concatenate([np.asarray(scores)[:n] for scores, n in self.chunks])[:-1]
        k = (host.shape[1] - 3) // 2
        ids = host[:, 3 : 3 + k].astype(np.int64).tolist()
        lps = host[:, 3 + k :].tolist()
        return [
            ScoredToken(int(row[0]), float(row[1]), list(zip(i, lp)), int(row[2])) for row, i, lp in zip(host, ids, lps)
        ]
