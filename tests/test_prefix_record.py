"""The prefix cache's host record, without a model (issue 38): which prefix a prompt may reuse (never a
token past the true common prefix), which slot it goes to, and the record's life. The device copy and
the runner: test_prefix_cache.py and test_prefix_reuse_edges.py."""

from __future__ import annotations

import pytest

from hkserve.engine.prefix_cache import PrefixCache, Reuse, common_prefix


def test_common_prefix_stops_at_the_first_difference_wherever_it_is():
    a = [3, 1, 4, 1, 5]
    assert common_prefix(a, a) == 5
    assert common_prefix(a, [3, 1, 4, 1, 6]) == 4  # differ at the shorter list's last token
    assert common_prefix(a, [3, 1, 4, 1, 6, 9]) == 4
    assert common_prefix([3, 1, 4, 1, 6, 9], a) == 4
    assert common_prefix(a, [0]) == 0 and common_prefix(a, []) == 0
    assert common_prefix(a, a + [2]) == 5


def test_a_prompt_differing_only_at_the_records_last_token_reuses_one_token_less():
    cache = PrefixCache(2, "on", min_reuse=4)
    record = list(range(10, 30))  # 20 tokens
    cache.admitted(0, record)
    cache.finished(0, 20)
    changed = record[:-1] + [99, 5, 6]
    assert cache.usable(0, changed) == 19
    assert cache.place(changed, [0, 1]) == (0, Reuse(0, 19))
    assert cache.usable(0, record[:-1] + [99]) == 19  # the new prompt as long as the record
    # The record's last valid token is a generated one: the delivered token past it was never written.
    cache.admitted(1, record[:8])
    for t in (40, 41, 42):
        cache.delivered(1, t)
    cache.finished(1, 10)  # prompt + 40, 41 written
    assert cache.usable(1, record[:8] + [40, 77, 1]) == 9
    assert cache.usable(1, record[:8] + [40, 41, 42, 1]) == 10


def test_modes_and_bounds_of_the_constructor():
    with pytest.raises(ValueError) as refused:
        PrefixCache(1, "fast")
    assert str(refused.value) == "prefix cache mode must be one of on, exact, off, got 'fast'"
    defaults = PrefixCache(1)
    assert (defaults.mode, defaults.granule, defaults.min_reuse) == ("on", 1, 16)
    defaults.admitted(0, list(range(40)))
    assert defaults.usable(0, list(range(16)) + [99]) == 16  # 16 tokens: worth a copy
    assert defaults.usable(0, list(range(15)) + [99]) == 0
    floor = PrefixCache(1, "on", granule=0, min_reuse=0)  # both at least 1
    floor.admitted(0, [1, 2, 3])
    assert floor.usable(0, [1, 9]) == 1 and floor.usable(0, [1, 2, 3, 4]) == 3
    assert floor.usable(0, [1, 2, 3]) == 2  # the whole prompt cached: its last token is prefilled again


def test_a_prompt_without_a_usable_prefix_takes_the_least_recently_used_free_slot():
    cache = PrefixCache(3, "on", min_reuse=2)
    assert cache.place([1, 2, 3], [2, 0, 1]) == (2, None)  # none used yet: the first listed
    for slot, prompt in ((1, [5, 5, 5]), (2, [6, 6, 6]), (0, [7, 7, 7])):
        cache.admitted(slot, prompt)
        cache.finished(slot, 3)
    assert cache.place([1, 2, 3], [0, 1, 2]) == (1, None)
    assert cache.place([6, 6, 6, 1], [0, 1, 2], lookup=False) == (1, None)  # no lookup: no reuse either
    cache.admitted(1, [8, 8, 8])  # admission refreshes the clock too
    assert cache.place([1, 2, 3], [0, 1, 2]) == (2, None)
    cache.forget(2)  # forgetting the content keeps the slot's place in the LRU order
    assert cache.place([1, 2, 3], [0, 2]) == (2, None)
    assert (cache.looked_up, cache.hit) == (3 + 3 + 3 + 3, 0)  # the lookup-free placement counted nothing


def test_ties_go_to_a_free_slot_then_to_the_most_recently_used():
    cache = PrefixCache(4, "on", min_reuse=2)
    for slot in (0, 1, 2):
        cache.admitted(slot, [1, 2, 3, 4, 5])
        cache.finished(slot, 5)
    cache.admitted(3, [1, 2, 3, 4, 5])  # running, and the most recent
    assert cache.place([1, 2, 3, 4, 9], [0, 1, 2]) == (2, Reuse(2, 4))  # free, most recent among free
    assert cache.place([1, 2, 3, 4, 9], [0, 1]) == (1, Reuse(1, 4))
    # Only the running slot holds the longest prefix: copied to the LRU free slot.
    cache.admitted(3, [1, 2, 3, 4, 5, 6, 7])
    assert cache.place([1, 2, 3, 4, 5, 6, 0], [1, 0]) == (0, Reuse(3, 6))
    assert cache.hit == 4 + 4 + 6


def test_the_reusable_part_of_a_record_and_its_life():
    cache = PrefixCache(2, "on", min_reuse=1)
    cache.admitted(0, [1, 2, 3, 4])  # running: its whole prompt is in memory
    assert cache.usable(0, [1, 2, 3, 4, 5]) == 4
    cache.delivered(0, 5)
    cache.delivered(0, 6)
    assert cache.usable(0, [1, 2, 3, 4, 5, 6, 7]) == 4  # generated tokens count once the request ends
    cache.finished(0, 9)  # more written than recorded: the record bounds it
    assert cache.usable(0, [1, 2, 3, 4, 5, 6, 7]) == 6
    cache.finished(0, 2)
    assert cache.usable(0, [1, 2, 3, 4, 5, 6, 7]) == 2
    cache.admitted(1, [1, 2, 3])
    cache.clear()
    assert cache.usable(0, [1, 2, 3, 9]) == 0 and cache.usable(1, [1, 2, 3, 9]) == 0
    assert cache.place([1, 2, 3, 9], [0, 1]) == (0, None)  # clearing keeps the LRU order: 0 is older


def test_exact_mode_reuses_whole_granules_of_prefill_computed_tokens():
    cache = PrefixCache(1, "exact", granule=4, min_reuse=4)
    cache.admitted(0, list(range(11)))
    cache.delivered(0, 11)
    cache.finished(0, 12)
    assert cache.usable(0, list(range(13))) == 8  # 11 prefilled, 12 written: whole granules of the 11
    assert cache.usable(0, list(range(7)) + [0]) == 4
    assert cache.usable(0, list(range(3)) + [0]) == 0
    cache.admitted(0, list(range(11)), exact=False)
    assert cache.usable(0, list(range(13))) == 0
    single = PrefixCache(1, "exact", granule=1, min_reuse=1)
    single.admitted(0, [1, 2, 3], exact=False)  # a scoring prefill: not one token of it is exact
    assert single.usable(0, [1, 2, 3, 4]) == 0


def test_off_mode_places_without_looking():
    cache = PrefixCache(2, "off", min_reuse=1)
    cache.admitted(0, [1, 2, 3])
    cache.finished(0, 3)
    assert cache.place([1, 2, 3, 4], [1, 0]) == (1, None)
    assert (cache.looked_up, cache.hit) == (0, 0)


def test_by_age_orders_slots_least_recently_used_first():
    """The order a paged pool evicts idle slots' cached blocks in: admissions and finishes both count
    as a use; the slots asked about only, whatever order they are given in."""
    cache = PrefixCache(4, "on", min_reuse=4)
    for slot in (2, 0, 3, 1):
        cache.admitted(slot, [slot] * 8)
    cache.finished(2, 8)  # slot 2 used last now
    assert cache.by_age([0, 1, 2, 3]) == [0, 3, 1, 2]
    assert cache.by_age([2, 1, 0]) == [0, 1, 2] and cache.by_age([]) == []
