"""What the machine allows, measured in the same run as the engine: memory bandwidth (→ tok/s if every
decode step must stream all weights) and matmul FLOP/s (→ tok/s if every token costs 2 FLOPs per weight)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure_host_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best host memory read bandwidth (bytes/s): numpy sums of an array far larger than the caches,
    one chunk per core (numpy releases the GIL), since the engine's step on a CPU also runs on every core."""
    data = np.full(megabytes * 2**20 // 4, 1.0, np.float32)
    chunks = np.array_split(data, os.cpu_count() or 1)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def measure_device_bandwidth(megabytes: int = 4096, repeats: int = 10) -> float:
    """Best device memory bandwidth (bytes/s) of a jitted elementwise pass over an array in the default
    device's memory (HBM on a GPU): every byte is read once and written once, and both count."""
    x = jnp.ones(megabytes * 2**20 // 4, jnp.float32)
    bump = jax.jit(lambda a: a + 1)  # not `a + 0`, which XLA may fold into no copy at all
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def measure_bandwidth(method: str, megabytes: int) -> float:
    """`method` host | device | auto (device on an accelerator, host memory on a CPU backend)."""
    if method == "auto":
        method = "host" if jax.default_backend() == "cpu" else "device"
    return measure_host_bandwidth(megabytes) if method == "host" else measure_device_bandwidth(megabytes)


def measure_matmul(n: int, dtype, repeats: int = 10) -> float:
    """Best matmul FLOP/s of XLA on this backend (jit of an n×n dot in `dtype`, after its compile)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time used over `seconds` (Linux /proc/stat; None elsewhere):
    other work running beside the benchmark lowers every figure, so the report says how busy it was."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 3)


def weights_per_token(config) -> int:
    """Weights one decode step reads and multiplies: all of them, except that an untied input
    embedding table is only indexed (one row per token). A tied table counts once, as the head."""
    return config.n_params - (0 if config.tie_embeddings else config.vocab_size * config.dim)
