"""What `hkserve bench serve`'s clients send: request i's prompt and reply length, the same for the HTTP
clients and the in-process runner (bench/serve_runner.py), and the long prompt of --long-prompt-every.

--lengths fixed: prompt i is PROMPTS[i % 4] as text and every reply is --max-tokens long.
--lengths chat: prompt and reply lengths drawn from a chat-like distribution with long tails, the
same for every run (seed CHAT_SEED): each a lognormal, prompt tokens with median PROMPT_MEDIAN and
sigma PROMPT_SIGMA (p90 ~3.6x, p99 ~10x the median), reply tokens with median REPLY_MEDIAN and sigma
REPLY_SIGMA (p99 ~6.4x), rounded; the reply clipped to [1, max_len // 2] and the prompt to
[1, max_len - reply], so every request fits the context and a long prompt keeps its reply. The
prompt is sent as token ids, drawn (same seed) from the tokens of PROMPTS, so its length is exact
and no two prompts share a prefix the prefix cache could reuse.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

PROMPTS = [
    "Once upon a time, in a small village,",
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "The history of the printing press begins",
]
CHAT_SEED = 34
PROMPT_MEDIAN, PROMPT_SIGMA = 200, 1.0  # tokens; lognormal(log(median), sigma)
REPLY_MEDIAN, REPLY_SIGMA = 100, 0.8
LONG_PROMPT_TOKENS = 4096  # --long-prompt-every's prompt, at most max_len - LONG_REPLY_TOKENS
LONG_REPLY_TOKENS = 16
LONG_SEED = 10_000  # the k-th long prompt's sampling seed is LONG_SEED + k


class Job(NamedTuple):
    """One request of the workload."""

    prompt: str | list[int]  # what the HTTP client sends: text (fixed) or token ids (chat, long)
    ids: list[int]  # the same prompt as token ids, for the in-process runner
    max_tokens: int  # generated exactly (ignore_eos)


def fixed_jobs(prompt_ids: list[list[int]], max_tokens: int) -> list[Job]:
    """Today's workload: the four PROMPTS as text (`prompt_ids`: their tokens), --max-tokens each; request
    i is job i % 4."""
    return [Job(text, list(ids), max_tokens) for text, ids in zip(PROMPTS, prompt_ids, strict=True)]


def chat_lengths(n: int, max_len: int, seed: int = CHAT_SEED) -> list[tuple[int, int]]:
    """(prompt tokens, reply tokens) of n requests: the module's lognormals, clipped to fit max_len."""
    if max_len < 2:
        raise ValueError(f"a chat request needs a context of 2 tokens or more, got --max-len {max_len}")
    rng = np.random.default_rng(seed)
    medians, sigmas = np.log([PROMPT_MEDIAN, REPLY_MEDIAN]), [PROMPT_SIGMA, REPLY_SIGMA]
    drawn = np.rint(rng.lognormal(medians, sigmas, (n, 2))).astype(int)  # [n, 2]: row i whatever n is
    prompts, replies = drawn[:, 0], drawn[:, 1]
    replies = np.clip(replies, 1, max_len // 2)
    prompts = np.clip(prompts, 1, max_len - replies)
    return [(int(p), int(r)) for p, r in zip(prompts, replies, strict=True)]


def chat_jobs(n: int, vocabulary: list[int], max_len: int, seed: int = CHAT_SEED) -> list[Job]:
    """n requests of chat_lengths, each prompt drawn from `vocabulary` (token ids)."""
    rng = np.random.default_rng(seed + 1)  # its own stream: the lengths do not depend on the vocabulary
    jobs = []
    for prompt, reply in chat_lengths(n, max_len, seed):
        ids = [int(t) for t in rng.choice(vocabulary, prompt)]
        jobs.append(Job(ids, ids, reply))
    return jobs


class LongPrompts:
    """--long-prompt-every's requests: each call a new prompt of `length` = LONG_PROMPT_TOKENS tokens,
    clipped to what max_len leaves after its LONG_REPLY_TOKENS-token reply. Each is drawn afresh (seeded
    by its number), so none is a prefix-cache hit of an earlier one: every arrival costs its prefill."""

    def __init__(self, vocabulary: list[int], max_len: int, seed: int = CHAT_SEED):
        self.length = min(LONG_PROMPT_TOKENS, max_len - LONG_REPLY_TOKENS)
        if self.length < 1:
            raise ValueError(f"--long-prompt-every needs --max-len above {LONG_REPLY_TOKENS}, got {max_len}")
        self.vocabulary, self.seed = vocabulary, seed
        self._numbers = itertools.count()  # next() is atomic under the GIL: arrivals come from threads

    def __call__(self) -> Job:
        rng = np.random.default_rng((self.seed + 2, next(self._numbers)))
        ids = [int(t) for t in rng.choice(self.vocabulary, self.length)]
        return Job(ids, ids, LONG_REPLY_TOKENS)


def distribution() -> dict:
    """The chat distribution's parameters, for the report's settings."""
    return {
        "seed": CHAT_SEED,
        "prompt_lognormal_median": PROMPT_MEDIAN,
        "prompt_lognormal_sigma": PROMPT_SIGMA,
        "reply_lognormal_median": REPLY_MEDIAN,
        "reply_lognormal_sigma": REPLY_SIGMA,
    }
