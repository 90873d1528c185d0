"""The host side of prefix_copy.py, without a model: where a prefill with a reused prefix starts (and
what it refuses before any device work), and how a prompt is cut into prefill chunks. The device copy
itself: test_prefix_copy_device.py, and with the model test_prefix_cache.py and test_prefix_reuse_edges.py."""

from __future__ import annotations

import numpy as np
import pytest

from hkserve.engine.prefix_cache import Reuse
from hkserve.engine.prefix_copy import Chunk, check_reuse, plan_chunks

HELD = np.asarray([5, 40, 128])  # tokens each of 3 slots holds


def test_a_valid_reuse_starts_the_prefill_after_the_prefix():
    assert check_reuse(None, 0, 10, 3, HELD, "off", None) == 0
    assert check_reuse(Reuse(1, 0), 0, 10, 3, HELD, "off", None) == 0  # nothing reused: no mode needed
    assert check_reuse(Reuse(1, 1), 0, 10, 3, HELD, "on", None) == 1
    assert check_reuse(Reuse(0, 5), 1, 10, 3, HELD, "on", None) == 5  # slot 0 is a source like any other
    assert check_reuse(Reuse(1, 40), 2, 41, 3, HELD, "on", None) == 40  # all the source holds, one to prefill
    assert check_reuse(Reuse(2, 128), 0, 200, 3, HELD, "exact", 64) == 128
    assert check_reuse(Reuse(0, 0), 2, 5, 3, HELD, "exact", 64) == 0


@pytest.mark.parametrize(
    "reuse, slot, n, mode, chunk, message",
    [
        (Reuse(1, 4), 0, 10, "off", None, "prefix reuse asked of an engine made with prefix_cache='off'"),
        (Reuse(1, 10), 0, 10, "on", None, "cannot reuse Reuse(source=1, length=10) for a prompt of 10 tokens"),
        (Reuse(1, -1), 0, 10, "on", None, "cannot reuse Reuse(source=1, length=-1) for a prompt of 10 tokens"),
        (Reuse(3, 4), 0, 10, "on", None, "cannot reuse Reuse(source=3, length=4) for a prompt of 10 tokens"),
        (Reuse(-1, 4), 0, 10, "on", None, "cannot reuse Reuse(source=-1, length=4) for a prompt of 10 tokens"),
        (Reuse(1, 4), 3, 10, "on", None, "cannot reuse Reuse(source=1, length=4) for a prompt of 10 tokens"),
        (Reuse(1, 4), -1, 10, "on", None, "cannot reuse Reuse(source=1, length=4) for a prompt of 10 tokens"),
        (Reuse(1, 41), 0, 50, "on", None, "slot 1 holds 40 tokens, not 41"),
        (Reuse(2, 100), 0, 200, "exact", 64, "exact reuse is whole chunks of 64 tokens, not 100"),
    ],
)
def test_an_impossible_reuse_is_refused_naming_why(reuse, slot, n, mode, chunk, message):
    with pytest.raises(ValueError) as refused:
        check_reuse(reuse, slot, n, 3, HELD, mode, chunk)
    assert str(refused.value) == message


def test_chunk_plans_at_bucket_and_window_edges():
    def window(s):
        return 128 if s < 128 else 256

    buckets = (8, 16, 32)
    assert plan_chunks(8, 0, buckets, window) == [Chunk(0, 8, 8, 0)]  # exactly a bucket: that bucket
    assert plan_chunks(9, 0, buckets, window) == [Chunk(0, 9, 16, 0)]
    assert plan_chunks(64, 0, buckets, window) == [Chunk(0, 32, 32, 0), Chunk(32, 64, 32, 128)]
    assert plan_chunks(116, 100, buckets, window) == [Chunk(100, 116, 16, 128)]  # a suffix: smallest bucket
    assert plan_chunks(140, 100, buckets, window) == [Chunk(100, 132, 32, 128), Chunk(132, 140, 8, 256)]
    assert plan_chunks(10, 10, buckets, window) == []
    assert plan_chunks(130, 0, (8,), window, fixed=64) == [
        Chunk(0, 64, 64, 0),
        Chunk(64, 128, 64, 128),
        Chunk(128, 130, 64, 256),
    ]
    assert plan_chunks(64, 64, (8,), window, fixed=64) == []
    with pytest.raises(ValueError) as refused:
        plan_chunks(130, 65, (8,), window, fixed=64)
    assert str(refused.value) == "a fixed-chunk prefill starts at a multiple of 64, not 65"
