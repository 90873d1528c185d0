"""The engine's decode state and the errors of its limits: a request too long for a slot's context,
and a decode state lost to a failed donated call."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hkserve.model.config import ModelConfig
from hkserve.model.memory import KVMemory
from hkserve.model.paged_memory import PagedKVMemory
from hkserve.model.sampling import SampleSettings, TokenHistory
from hkserve.model.sharding import memory_shardings
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


def check_max_tokens(max_tokens: int, scoring: bool) -> None:
    """The one check of a request's max_tokens on its own (the runner's submit and the API's request
    preparation call it; check_context checks it against the context): at least 1, or 0 when the
    prompt's scores are all that is wanted."""
    if scoring and max_tokens < 0:
        raise ValueError(f"max_tokens must be at least 0, got {max_tokens}")
    if not scoring and max_tokens < 1:
        raise ValueError(
            f"max_tokens must be at least 1, got {max_tokens} (0 returns only the prompt, scored: it needs echo"
            " or prompt_logprobs)"
        )


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
    memory: KVMemory | PagedKVMemory | VQMemory  # by config.memory and the engine's kv layout
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


def state_shardings(config: ModelConfig, mesh: Mesh, layout: str = "static") -> DecodeState:
    """Where the decode state lives: per-slot rows over "data", the memory as model/sharding.py says."""
    rows, table = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None))
    settings = SampleSettings(*([rows] * (len(SampleSettings._fields) - 1)), logit_bias=table)
    return DecodeState(memory_shardings(config, mesh, layout), rows, settings, TokenHistory(table, table))


def check_options(config: ModelConfig, prefix_cache: str, modes: tuple[str, ...]) -> None:
    """Refuse what an engine of this model cannot serve, before anything is built."""
    if prefix_cache not in modes:
        raise ValueError(f"prefix cache mode must be one of {', '.join(modes)}, got {prefix_cache!r}")
    if prefix_cache != "off" and config.memory == "vq":
        raise ValueError(
            "prefix caching needs a per-position KV memory: a Transformer-VQ memory is a compressed state "
            "that can be reused only at the exact position it was saved (use --prefix-cache off)"
        )
    if config.vocab_size >= 2**24:
        raise ValueError("vocabularies of 2**24 tokens or more do not fit the packed step output")
