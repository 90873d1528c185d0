"""--long-prompt-every S: open-loop arrivals of a long prompt beside the measured closed-loop clients,
the k-th at S x k seconds after the phase starts (k = 1, 2, ...), whether or not the earlier ones have
finished. Their results are kept apart, so their tokens never count in the measured figures."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable


def arrivals(every: float, send: Callable[[int], None], stop, clock: Callable[[], float] = time.monotonic) -> int:
    """send(k) at start + every x k until `stop` (a threading.Event) is set → how many were sent. A late
    arrival (send or the thread ran late) is sent at once, none skipped: the schedule is from the start,
    not from the last send."""
    start, k = clock(), 1
    while not stop.wait(max(0.0, start + every * k - clock())):
        send(k)
        k += 1
    return k - 1


@contextlib.contextmanager
def long_prompts(every: float | None, one: Callable[[int], dict], clock: Callable[[], float] = time.monotonic):
    """While the block runs, one(k) in its own thread at each arrival; yields the list of their results,
    complete once the block has ended (arrivals stop, those in flight are waited for; the first error of
    one is raised). every None: no arrivals."""
    results: list[dict] = []
    if every is None:
        yield results
        return
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def call(k: int) -> None:
        try:
            results.append(one(k))
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)

    def send(k: int) -> None:
        thread = threading.Thread(target=call, args=(k,), daemon=True)
        threads.append(thread)
        thread.start()

    stop = threading.Event()
    sender = threading.Thread(target=arrivals, args=(every, send, stop, clock), daemon=True)
    sender.start()
    try:
        yield results
    finally:
        stop.set()
        sender.join()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
