"""The paged KV layout through Engine and InferenceRunner on tiny random models (issue 34, step 1):
greedy and seeded outputs equal the static layout's, alone and among neighbours of random lengths
(XLA gather and CPU kernel paths; prefix reuse in place); a pool too small for a request's
worst case queues it until blocks free; blocks freed while still in use change outputs (the block
pool's invariants are checked after every pass)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.checkpoint.quantize import convert_params
from hkserve.engine.block_pool import BlockPool
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import block_bytes
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels import dispatch
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96, sliding_window=24, sliding_layers=(True, False))
F32 = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 7))


def make_runner(path: str, layout: str, slots: int = 4, kv: str = "auto", **engine_args) -> InferenceRunner:
    """path "xla" (float32 weights), "xla-int8" (int8 weights, XLA's dots and attention), "kernels" (int8
    weights on the CPU kernels) or "kernels-f32" (float32 weights, XLA's dots, the kernel's decode attention);
    kv: the memory's dtype (ModelConfig.kv_dtype, --kv-dtype)."""
    config, params, kernels = CONFIG.replace(kv_dtype=kv), F32, None
    if path in ("kernels", "xla-int8"):  # int8 weights: the CPU kernels, decode attention in place (paged: by table)
        config, params = convert_params(F32, config, "int8")
    if path in ("kernels", "kernels-f32"):
        kernels = dispatch.resolve("auto", config.dtype)
        assert kernels is not None and kernels.attention_only == (path == "kernels-f32")
    model = build_model(config, kernels)
    args = {"block_size": 16, **engine_args} if layout == "paged" else engine_args
    engine = Engine(
        model, params, EngineOptions(slots=slots, max_len=160, prefill_buckets=(8, 32), kv_layout=layout, **args)
    )
    return InferenceRunner(engine, max_queue=256)  # never started: the test's thread is the loop


def run(runner: InferenceRunner, requests: list[Request], watch=None) -> list[list[int]]:
    """Drive the loop until every request ends; `watch(runner)` after every pass."""
    streams = [runner.submit(r) for r in requests]
    while not all(s.done for s in streams):
        runner.iterate()
        if watch is not None:
            watch(runner)
    out = []
    for s in streams:
        events = list(s)
        assert events[-1].finish_reason in ("stop", "length"), events[-1]
        out.append([e.token.id for e in events if e.token is not None])
    return out


def neighbours(n: int, seed: int) -> list[Request]:
    """n requests of random prompt lengths (1..100: one-row, rows-program and two-chunk prefills) and
    reply lengths, greedy and seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 100))]
        sampling = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.9, seed=i)
        out.append(Request(prompt, rng.randint(1, 40), sampling))
    return out


TARGETS = [
    Request([5, 17, 33, 2, 64, 9, 11], 40, SamplingParams(temperature=0.0)),
    Request(list(range(3, 70)), 30, SamplingParams(temperature=0.8, seed=11)),
]


@pytest.mark.parametrize("path", ["xla", "kernels", "kernels-f32"])
def test_paged_outputs_equal_static_alone_and_among_16_neighbours(path):
    static, paged = make_runner(path, "static"), make_runner(path, "paged")
    mixed = neighbours(16, seed=3)
    mixed[5:5], mixed[12:12] = [TARGETS[0]], [TARGETS[1]]
    want_alone = [run(static, [t])[0] for t in TARGETS]
    assert [run(paged, [t])[0] for t in TARGETS] == want_alone
    want_mixed = run(static, mixed)
    got_mixed = run(paged, mixed, watch=lambda r: r.engine.kv_pool.check())
    assert got_mixed == want_mixed
    assert [got_mixed[5], got_mixed[12]] == want_alone  # batch invariance on the paged layout
    assert paged.engine.kv_pool.used == 0  # prefix cache off: every block back once the requests end


def test_bf16_kv_greedy_equal_on_the_kernel_and_xla_paths():
    """--kv-dtype bf16: the memory holds bf16 (written rounded once by prefill and decode), and greedy
    replies read through the kernel's bf16 variant equal those of XLA's upcast reads of the same bits.
    Paged (the kernel through block tables); the static layout gives the paged one's bits with a bf16
    memory too (test_paged_attention.py)."""
    greedy = [TARGETS[0], Request(list(range(3, 70)), 30, SamplingParams(temperature=0.0))]
    kernel, xla = make_runner("kernels", "paged", kv="bfloat16"), make_runner("xla-int8", "paged", kv="bfloat16")
    assert kernel.engine.state.memory.k.dtype == jnp.bfloat16 == xla.engine.state.memory.v.dtype
    assert run(kernel, greedy) == run(xla, greedy)


def test_float_weights_greedy_replies_equal_on_the_attention_kernel_and_xla():
    """Float32 weights under --kernels auto (the kernel's decode attention, paged by table) and --kernels xla
    (XLA's gather): their logits differ in the last bits (test_float_attention_kernel.py), greedy replies not."""
    greedy = [TARGETS[0], Request(list(range(3, 70)), 30, SamplingParams(temperature=0.0))]
    greedy += [r for r in neighbours(8, seed=5) if r.sampling.temperature == 0.0]
    assert run(make_runner("kernels-f32", "paged"), greedy) == run(make_runner("xla", "paged"), greedy)


def test_a_bf16_pool_of_the_same_mib_holds_twice_the_blocks():
    f32, bf16 = (make_runner("xla", "paged", kv=kv, kv_cache_mb=0.5) for kv in ("float32", "bfloat16"))
    assert block_bytes(CONFIG.replace(kv_dtype="bfloat16"), 16) * 2 == block_bytes(CONFIG, 16)
    assert bf16.engine.kv_pool.total == 2 * f32.engine.kv_pool.total > 0
    assert bf16.engine.state.memory.k.nbytes == f32.engine.state.memory.k.nbytes


def test_prefix_reuse_copies_blocks_and_keeps_outputs():
    """Prefix cache on: a second prompt sharing 40 tokens with a finished one reuses its blocks
    (cached_tokens > 0), and replies equal the static layout's; idle slots keep their blocks."""
    prefix = list(range(10, 50))
    first = Request(prefix + [1, 2], 8, SamplingParams(temperature=0.0))
    second = Request(prefix + [3, 4, 5], 8, SamplingParams(temperature=0.0))
    outs = {}
    for layout in ("static", "paged"):
        runner = make_runner("xla", layout, slots=2, prefix_cache="on")
        outs[layout] = run(runner, [first]) + run(runner, [second, Request([7] * 50, 6)])
        streams = [runner.submit(Request(prefix + [9], 4, SamplingParams(temperature=0.0)))]
        while not streams[0].done:
            runner.iterate()
        assert streams[0].cached_tokens == 40
        if layout == "paged":
            runner.engine.kv_pool.check()
            assert runner.stats().kv_blocks_used > 0  # kept for the cache
    assert outs["paged"] == outs["static"]


def test_a_pool_too_small_for_a_worst_case_queues_the_request_until_blocks_free():
    """The pool holds 10 blocks of 16 (one 160-token request); each request's worst case takes 6: the
    second waits while the first runs, then runs and both reply as alone."""
    mb = 10 * block_bytes(CONFIG, 16) / 2**20
    runner = make_runner("xla", "paged", slots=4, kv_cache_mb=mb)
    assert runner.engine.kv_pool.total == 10
    a = Request(list(range(1, 40)), 50, SamplingParams(temperature=0.0))  # 89 positions: 6 blocks
    b = Request(list(range(40, 90)), 40, SamplingParams(temperature=0.0))  # 90: 6 blocks
    alone = [run(runner, [a])[0], run(runner, [b])[0]]
    seen = []
    together = run(runner, [a, b], watch=lambda r: seen.append(r.stats()))
    assert together == alone
    assert any(s.running == 1 and s.waiting == 1 for s in seen)  # b queued behind a's promise
    assert max(s.kv_blocks_used for s in seen) <= 10 and all(s.kv_blocks_total == 10 for s in seen)


def test_blocks_reused_heavily_by_many_short_requests_keep_every_reply():
    """A pool of 4 slots' worth and 24 requests: blocks are freed and taken again (last freed, first
    taken) many times over; every reply equals its alone reply. A block given to a second slot while
    the first still reads it (planted: BlockPool.grow leaving the block on the free list) fails the
    pool's check and, without it, changes 21 of the 24 replies."""
    mb = 40 * block_bytes(CONFIG, 16) / 2**20
    runner = make_runner("xla", "paged", slots=4, kv_cache_mb=mb)
    requests = neighbours(24, seed=9)
    alone = [run(runner, [r])[0] for r in requests]
    taken = []
    real_grow = runner.engine.kv_pool.grow

    def counting_grow(slot, tokens):
        before = runner.engine.kv_pool.used
        real_grow(slot, tokens)
        taken.append(runner.engine.kv_pool.used - before)

    runner.engine.kv_pool.grow = counting_grow
    assert run(runner, requests, watch=lambda r: r.engine.kv_pool.check()) == alone
    assert sum(taken) > 2 * runner.engine.kv_pool.total  # every block was taken again, more than twice


def test_block_pool_accounting_by_shard():
    pool = BlockPool(8, 4, slots=4, max_blocks=3, shards=2)  # slots 0-1 take blocks 0-3, slots 2-3 blocks 4-7
    pool.grow(0, 9)
    pool.grow(2, 4)
    assert pool.held[0] == [0, 1, 2] and pool.held[2] == [4] and pool.used == 4
    assert list(pool.table[0]) == [0, 1, 2] and list(pool.table[1]) == [8, 8, 8]
    pool.reserve(2, 12)  # slot 2 may grow to 3 blocks: shard 1 has 1 left
    assert pool.fits(3, 4) and not pool.fits(3, 5)
    assert not pool.fits(1, 5) and pool.fits(1, 4)  # shard 0: slot 0 holds 3 (idle: evictable)
    assert pool.fits_evicting_idle(1, 16)
    with pytest.raises(Exception, match="free blocks"):
        pool.grow(1, 8)
    assert pool.held[1] == []  # a failed grow takes nothing
    pool.truncate(0, 5)
    assert pool.held[0] == [0, 1] and pool.table[0, 2] == 8
    pool.check()
    pool.grow(1, 4)
    assert pool.held[1] == [2]  # the last freed block is taken first
    pool.drop(0)
    pool.check()
    with pytest.raises(ValueError, match="divide"):
        BlockPool(7, 4, slots=4, max_blocks=3, shards=2)


def test_warmup_on_the_paged_layout_gives_every_block_back():
    runner = make_runner("xla", "paged", slots=2, prefix_cache="on")
    runner.engine.structured = True  # the split step of constrained batches too
    runner.engine.warmup()
    runner.engine.kv_pool.check()
    assert runner.engine.kv_pool.used == 0 and not runner.engine.kv_pool.dirty
    assert run(runner, [TARGETS[0]]) == run(make_runner("xla", "static", slots=2), [TARGETS[0]])


def test_kv_options_an_engine_cannot_honour_are_refused():
    model = build_model(CONFIG)
    with pytest.raises(ValueError, match="use it with --kv-layout paged"):
        Engine(model, F32, EngineOptions(slots=2, max_len=160, kv_layout="static", kv_cache_mb=1.0))
    with pytest.raises(ValueError, match="block size"):
        Engine(model, F32, EngineOptions(slots=2, max_len=160, kv_layout="paged", block_size=0))
    with pytest.raises(ValueError, match="less than one request of --max-len 160"):
        Engine(model, F32, EngineOptions(slots=2, max_len=160, kv_layout="paged", block_size=16, kv_cache_mb=0.01))
    with pytest.raises(ValueError, match="kv layout must be one of"):
        Engine(model, F32, EngineOptions(slots=2, max_len=160, kv_layout="pages"))


def test_the_device_table_is_sent_a_snapshot_never_the_pools_own_array(monkeypatch):
    """JAX on the CPU may take a suitably aligned numpy argument without copying it and read it when the
    program runs, after the call returned; the pool edits its table for the next request meanwhile. Once
    a decode step read a half-edited table ("a row's past lies in a block outside the pool", about one
    run in four of the 16-neighbour test above). Every table sent must be a copy."""
    runner = make_runner("kernels", "paged")
    engine, sent = runner.engine, []
    compiled = engine._compiled_fn

    def spy(kind: str, window: int):
        fn = compiled(kind, window)
        if kind != "table":
            return fn
        return lambda state, table: (sent.append(table), fn(state, table))[1]

    monkeypatch.setattr(engine, "_compiled_fn", spy)
    assert run(runner, TARGETS) and sent
    assert not any(np.shares_memory(table, engine.kv_pool.table) for table in sent)
