"""Events from the runner's loop thread to asyncio consumers, handed over in batches.

Each decode step produces one event per running request. Scheduling each on the consumers' event
loop with its own `call_soon_threadsafe` costs a wake-up of that loop (a write to its self-pipe and
a callback) per token per request; a Mailbox queues them and schedules one delivery for all the
events queued until that delivery runs: one wake-up per step, whatever the number of requests.
Each queue still receives its events in the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop → its Mailbox
_mailboxes_lock = threading.Lock()


class Mailbox:
    """Items for queues of one event loop, posted from any thread, delivered on the loop in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []  # posted, not yet delivered, in order
        self._scheduled = False  # a delivery is scheduled on the loop and has not started yet

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def mailbox_for(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The one Mailbox of an event loop (dropped with the loop)."""
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = Mailbox(loop)
        return box
