"""The engine's decode state and the errors of its limits: a request too long for a slot's context,
and a decode state lost to a failed donated call."""

from __future__ import annotations

from typing import NamedTuple

import jax

from hkserve.model.memory import KVMemory
from hkserve.model.sampling import SampleSettings, TokenHistory
from hkserve.model.vq_memory import VQMemory


class ContextLengthError(ValueError):
    """A request that cannot fit a slot's context. One message for every front end (HTTP, the CLI),
    carrying all the numbers a client needs to shorten it."""

    def __init__(self, max_len: int, prompt_tokens: int, max_tokens: int):
        super().__init__(
            f"This model's maximum context length is {max_len} tokens; the request needs "
            f"{prompt_tokens + max_tokens} ({prompt_tokens} prompt tokens + {max_tokens} to generate)"
        )
        self.max_len, self.prompt_tokens, self.max_tokens = max_len, prompt_tokens, max_tokens


def check_context(max_len: int, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a request whose prompt and generation cannot fit a context of `max_len` tokens."""
    if prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    if prompt_tokens + max_tokens > max_len:
        raise ContextLengthError(max_len, prompt_tokens, max_tokens)


class DecodeStateLost(RuntimeError):
    """A device call failed after its inputs were donated: the decode state of every slot is gone, so
    every running request is lost and the engine must be reset."""


class DecodeState(NamedTuple):
    memory: KVMemory | VQMemory  # by config.memory
    tokens: jax.Array  # [B] int32: each slot's last sampled token, the input of the next step
    settings: SampleSettings  # [B] per-slot sampling settings ([B, V] logit bias)
    history: TokenHistory  # [B, V] what the penalties see


def window_sizes(max_len: int, smallest: int = 128) -> tuple[int, ...]:
    """Attention windows: powers of two from `smallest`, capped by (and always including) max_len."""
    sizes, w = [], smallest
    while w < max_len:
        sizes.append(w)
        w *= 2
    return tuple(sizes) + (max_len,)
