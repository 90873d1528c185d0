"""The kernels' thread cap under other processes' load (hkserve/kernels/contention.py): the decision
from /proc's tick counts, read from a fake /proc so that no test depends on the machine's load, and
that a capped call computes the same bits."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import contention, ffi, pack


def test_cores_free_leaves_a_core_to_others_only_when_they_keep_most_of_one_busy():
    assert contention.cores_free(2, 0.0) == 2
    assert contention.cores_free(2, 0.3) == 2
    assert contention.cores_free(2, 0.7) == 1
    assert contention.cores_free(2, 2.0) == 1  # never fewer than the calling thread
    assert contention.cores_free(8, 2.9) == 5
    assert contention.cores_free(8, 0.2) == 8


def test_the_cap_moves_only_when_two_samples_in_a_row_ask_for_it():
    cap = contention.ThreadCap(2)
    assert not cap.update(1.0) and cap.cap == 0  # one busy sample: a burst, not yet a load
    assert not cap.update(0.0) and cap.cap == 0
    assert not cap.update(1.0)
    assert cap.update(1.0) and cap.cap == 1  # two in a row: capped at one thread
    assert not cap.update(1.0) and cap.cap == 1
    assert not cap.update(0.1) and cap.cap == 1
    assert cap.update(0.1) and cap.cap == 0  # quiet twice: uncapped


class FakeProc:
    """A /proc with three cores' tick counters and this process's user/system ticks."""

    def __init__(self, root: Path):
        self.root = root
        (root / "self").mkdir(parents=True)
        self.cpus = [[0] * 8 for _ in range(3)]  # user nice system idle iowait irq softirq steal
        self.own = [0, 0]  # utime, stime
        self.now = 100.0
        self.write()

    def write(self) -> None:
        total = [sum(c[i] for c in self.cpus) for i in range(8)]
        lines = ["cpu  " + " ".join(map(str, total + [0, 0]))]
        lines += [f"cpu{i} " + " ".join(map(str, c + [0, 0])) for i, c in enumerate(self.cpus)]
        lines += ["intr 1 2 3", "ctxt 5"]
        (self.root / "stat").write_text("\n".join(lines) + "\n")
        fields = ["S"] + ["0"] * 10 + [str(self.own[0]), str(self.own[1])] + ["0"] * 30
        (self.root / "self" / "stat").write_text("4242 (python3 (odd) name) " + " ".join(fields) + "\n")

    def advance(self, seconds: float, busy: list[float], own: float, steal: float = 0.0, hz: int = 100) -> None:
        """`seconds` pass; core i is busy busy[i] of them (user ticks, this process's `own` among them)."""
        for c, b in zip(self.cpus, busy):
            c[0] += round(b * seconds * hz)
            c[3] += round((1 - b) * seconds * hz)
        self.cpus[0][7] += round(steal * seconds * hz)
        self.own[0] += round(own * seconds * hz)
        self.now += seconds
        self.write()


def test_read_sample_counts_only_the_monitored_cores_and_this_process(tmp_path):
    fake = FakeProc(tmp_path)
    fake.advance(1.0, [0.5, 1.0, 1.0], own=0.25, steal=0.1)
    sample = contention.read_sample(frozenset({0, 1}), tmp_path, lambda: fake.now)
    assert sample == contention.CpuSample(busy=50 + 100 + 10, own=25, at=101.0)  # core 2 is not ours


def test_the_monitor_caps_while_another_process_holds_a_core_and_uncaps_when_it_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(contention.os, "sysconf", lambda name: 100)
    fake = FakeProc(tmp_path)
    caps = []
    monitor = contention.ContentionMonitor(caps.append, proc=tmp_path, clock=lambda: fake.now)
    sample = contention.read_sample(monitor.cores, tmp_path, lambda: fake.now)

    def poll(busy, own):
        nonlocal sample
        fake.advance(0.25, busy, own)
        sample = monitor.poll(sample)

    poll([1.0, 1.0], own=2.0)  # this process on both cores: nobody else
    poll([1.0, 1.0], own=2.0)
    assert caps == []
    poll([1.0, 1.0], own=1.0)  # another process holds a core's worth
    poll([1.0, 1.0], own=1.0)
    assert caps == [1]
    poll([1.0, 0.0], own=1.0)  # it stopped: one core idle
    poll([1.0, 0.0], own=1.0)
    assert caps == [1, 0]


def test_a_capped_kernel_call_computes_the_same_bits():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 576)).astype(np.float32)
    w = pack.pack(jnp.asarray(rng.integers(-127, 128, (576, 1536)).astype(np.int8)))
    scale = (rng.random(1536) * 0.02).astype(np.float32)
    call = jax.jit(lambda x, w, s: ffi.matmul(x, w, s, "w8a32", ffi.cpu_isa()))
    free = np.asarray(call(x, w, scale))
    try:
        ffi.set_thread_cap(1)
        assert ffi.thread_cap() == 1
        capped = np.asarray(call(x, w, scale))
    finally:
        ffi.set_thread_cap(0)
    assert ffi.thread_cap() == 0
    np.testing.assert_array_equal(capped, free)
