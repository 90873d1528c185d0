"""Start-up: a warm `hkserve serve` start (the compile cache its cold start filled) compiles nothing, and
`hkserve bench startup`'s record adds up; the compile counter's time is the union of nested spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, require_fixtures
from test_serve import tiny_home  # noqa: F401  (module-scoped fixture: a tiny GGUF model in a store)

from hkserve.cli.memory import MMAP_THRESHOLD
from hkserve.cli.serve import MAX_LOADED_PROGRAMS
from hkserve.cli.startup import CompileCounter


def bench_startup(home, weights: str, slots: int, max_len: int) -> list[dict]:
    """`hkserve bench startup --json` on the store's "tiny": its runs, cold then warm."""
    cmd = [sys.executable, "-m", "hkserve.cli.main", "bench", "startup", "--model", "tiny", "--weights", weights]
    cmd += ["--slots", str(slots), "--max-len", str(max_len), "--server-log", "--json"]
    env = {**os.environ, "HKSERVE_HOME": str(home)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    # Each start says it is ready as /health answers, and --server-log echoed the server's own log.
    assert result.stdout.count(f"{weights}: ready after ") == 2
    assert "serve| " in result.stderr and "startup: {" in result.stderr
    # Each serve fixed glibc's mmap threshold before loading (cli/memory.py: the heap compiles leave behind).
    assert result.stderr.count(f"malloc: mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB") == 2
    return json.loads(result.stdout.splitlines()[-1])["runs"]


def check_warm_start_compiles_nothing(runs: list[dict]) -> None:
    cold, warm = runs
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    # The cold start compiled and stored every program it did not find (two functions of one program: the
    # second finds the first's entry), so the counter sees compiles at all and none bypassed the cache ...
    assert cold["compiles"]["programs"] > 5
    assert cold["compiles"]["cache_misses"] == cold["cache_writes"] > 5
    # ... and the warm one compiled nothing: the engine's programs came from the program index (loaded from
    # their cache entries, not traced, lowered or even looked up: fewer of JAX's compile events), every one
    # the cold start indexed, and the few jits outside the engine's table (its state's) from the cache.
    assert warm["compiles"]["cache_misses"] == 0 and warm["cache_writes"] == 0
    assert cold["compiled"]["index_hits"] == 0 and cold["compiled"]["index_misses"] > 5
    assert (warm["compiled"]["index_hits"], warm["compiled"]["index_misses"]) == (cold["compiled"]["index_misses"], 0)
    assert warm["reply"] == cold["reply"]  # the same tokens


def tiny_sizes(slots: int, max_len: int) -> tuple[int, int]:
    """(f32 param bytes, KV memory bytes) of tiny-llama-tied, from its HF config: tied embeddings, no biases;
    K and V of every layer, slot and position (the default paged pool holds slots x max_len positions in
    blocks of 32), plus each slot's int32 step and its row of the int32 block table."""
    c = json.loads((require_fixtures() / "hf" / "tiny-llama-tied" / "config.json").read_text())
    d, f, hd, layers = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
    params = c["vocab_size"] * d + layers * per_layer + d
    table = slots * -(-max_len // 32)
    return 4 * params, 4 * (layers * 2 * slots * max_len * kv + slots + table)


def test_a_warm_start_compiles_nothing_and_the_record_adds_up(tiny_home):  # noqa: F811
    runs = bench_startup(tiny_home, "f32", slots=2, max_len=128)
    check_warm_start_compiles_nothing(runs)
    params, kv = tiny_sizes(slots=2, max_len=128)
    for r in runs:
        assert sum(r["seconds"].values()) == pytest.approx(r["ready_s"], abs=0.01)
        assert r["programs"]["mode"] == "background" and r["compiled_s"] >= r["ready_s"]
        # serve's default bound on the loaded programs applied (the compile cache is on), no reload missed it
        bound = {k: r["programs"][k] for k in ("max_loaded", "reload_misses")}
        assert bound == {"max_loaded": MAX_LOADED_PROGRAMS, "reload_misses": 0}
        assert 0 < r["programs"]["loaded"] <= MAX_LOADED_PROGRAMS
        assert r["seconds"]["compile"] > 0 and min(r["seconds"].values()) >= 0
        # the server's own CPU seconds (all its threads), growing from ready to all compiled
        assert 0 < r["cpu_s_client"] <= r["cpu_s_compiled"]
        memory = r["memory"]
        assert (memory["stored_weights"], memory["served_params"], memory["kv"]) == (params, params, kv)
        assert memory["other_arrays"] >= 0 and memory["not_arrays"] > 0
        assert sum(v for k, v in memory.items() if k not in ("rss", "stored_weights")) == memory["rss"]


@pytest.mark.slow
def test_a_warm_int8_start_of_more_buckets_compiles_nothing(tiny_home):  # noqa: F811
    """The int8 kernels' programs (packing, the FFI matmuls) and more prefill buckets and decode windows."""
    check_warm_start_compiles_nothing(bench_startup(tiny_home, "int8", slots=4, max_len=512))


def test_compile_time_is_the_union_of_nested_spans_within_the_phase():
    counter = CompileCounter()
    counter.close()  # fed by hand below, not by JAX
    for start, end in [(1.0, 4.0), (2.0, 3.0), (6.0, 7.0), (6.5, 9.0), (20.0, 21.0)]:
        counter._span("/jax/core/compile/jaxpr_trace_duration", start, end)
    counter._span("/jax/some/other_event", 10.0, 15.0)
    assert counter.seconds_within(0.0, 30.0) == pytest.approx(3.0 + 3.0 + 1.0)
    assert counter.seconds_within(2.5, 8.0) == pytest.approx(1.5 + 2.0)
    assert counter.seconds_within(10.0, 15.0) == 0.0
