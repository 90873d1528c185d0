"""What a `bench serve` client does when a request is refused, the same on the HTTP side and the in-process
runner's, so that a run against an overloaded server completes and says how often it was told no.

As the OpenAI Python SDK does by default: a 429, or no answer at all (CONNECTION_ERROR), is tried again,
up to `retries` times (default RETRIES), after the Retry-After seconds the answer carries when 0 <=
Retry-After <= 60 (hkserve sends 1 with each 429: a full admission queue, api/protocol.py's domain_error),
else after 0.5 x 2^n seconds, at most 8 (n: the retries so far). Any other refusal (another non-2xx
answer, or a stream that failed after its head, STREAM_ERROR) is not retried: a benchmark shows a failure
rather than paper over it. Every refused attempt is counted by its status, and no retry begins once the
phase has stopped (`wait` returns True).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

RETRIES = 2  # the OpenAI Python SDK's default max_retries
REJECTED = "429"  # "try again later": the server's refusal of a request it has no room for
CONNECTION_ERROR = "connection_error"  # counted for an attempt that got no answer (the connection failed)
RETRIED = frozenset({REJECTED, CONNECTION_ERROR})  # what a client sends again
STREAM_ERROR = "stream_error"  # counted for a 200 stream that failed: an error event, or a broken connection
MAX_RETRY_AFTER = 60.0  # seconds: a longer (or unparsable) Retry-After falls back to the backoff
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0


class Refused(Exception):
    """One attempt the server refused: its status ("429", "500", ..., STREAM_ERROR) and Retry-After seconds."""

    def __init__(self, status: str, retry_after: float | None = None):
        super().__init__(f"refused: {status}")
        self.status, self.retry_after = status, retry_after


class Outcome(NamedTuple):
    """One request of a phase after its attempts: the served attempt's figures, or none."""

    ttft: float  # seconds from the served attempt's send to its first token; nan when none came
    itl: list[float]  # seconds between its tokens' arrivals
    tokens: int  # tokens generated (the usage's count)
    served: bool = True  # whether an attempt was answered with its stream (after the refusals, if any)
    refusals: tuple[str, ...] = ()  # the status of each refused attempt, in order


UNSERVED = Outcome(float("nan"), [], 0, served=False)


def streamed(start: float, arrivals: list[float], tokens: int) -> Outcome:
    """A served attempt's Outcome: sent at `start`, its text tokens arriving at `arrivals` (perf_counter s)."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return Outcome(arrivals[0] - start if arrivals else float("nan"), gaps, tokens)


def retry_after(header: str | None) -> float | None:
    """A Retry-After header's seconds; None when absent, an HTTP date, or not a number."""
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


def delay(after: float | None, retries_so_far: int) -> float:
    """Seconds to wait before the next attempt: the server's Retry-After when usable, else the backoff."""
    if after is not None and 0 <= after <= MAX_RETRY_AFTER:
        return after
    return min(BACKOFF_S * 2**retries_so_far, BACKOFF_MAX_S)


def with_retries(attempt: Callable[[], Outcome], wait: Callable[[float], bool], retries: int = RETRIES) -> Outcome:
    """attempt() until it is served, refused with a status not RETRIED, refused 1 + `retries` times, or `wait(s)`
    (a threading.Event's wait: True once the phase has stopped) ends the waiting → the request's Outcome."""
    refusals: list[str] = []
    while True:
        try:
            return attempt()._replace(refusals=tuple(refusals))
        except Refused as e:
            refusals.append(e.status)
            if e.status not in RETRIED or len(refusals) > retries or wait(delay(e.retry_after, len(refusals) - 1)):
                return UNSERVED._replace(refusals=tuple(refusals))
