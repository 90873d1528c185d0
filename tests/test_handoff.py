"""The runner → asyncio hand-off: events posted from another thread reach each queue in order, with
one loop wake-up per batch of posts rather than one per event."""

from __future__ import annotations

import asyncio
import threading

from hkserve.engine.handoff import mailbox_for


def test_posts_from_another_thread_arrive_in_order_with_one_wakeup_per_batch():
    loop = asyncio.new_event_loop()
    try:
        wakeups = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wakeups.append(a) or schedule(*a)
        a, b = asyncio.Queue(), asyncio.Queue()
        box = mailbox_for(loop)
        assert mailbox_for(loop) is box
        poster = threading.Thread(
            target=lambda: [box.post(q, (name, i)) for i in range(5) for name, q in (("a", a), ("b", b))]
        )
        poster.start()
        poster.join()
        assert len(wakeups) == 1  # ten events, the loop not yet run: one delivery
        loop.run_until_complete(asyncio.sleep(0))
        assert [a.get_nowait() for _ in range(5)] == [("a", i) for i in range(5)]
        assert [b.get_nowait() for _ in range(5)] == [("b", i) for i in range(5)]
        box.post(a, "next")  # after a delivery, the next post schedules the next one
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert a.get_nowait() == "next"
    finally:
        loop.close()
    box.post(a, "too late")  # a closed loop: dropped, no error
