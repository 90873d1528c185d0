"""The Pallas paged decode-attention kernel (hkserve/model/paged_pallas.py), run in Pallas's
interpreter on the CPU: against a float64 reference over shuffled block tables (GQA 1/3/4, windows,
soft caps, sinks, bf16 pools, rows of length 1 to a full table, splits of the table), lowered to
Triton for CUDA, chosen by the dispatch (model/paged_memory.decode_kernel) with its fallbacks, and
through a tiny model and the engine: the logits and greedy tokens of XLA's gather path."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config
from jax import export
from test_attention_kernel import bf16_rounded, reference
from test_paged_attention import paged_copy
from test_paged_engine import TARGETS, make_runner, run

from hkserve.engine.requests import Request
from hkserve.model.build import build_model
from hkserve.model.paged_memory import KERNEL_ENV, decode_kernel, init_paged_memory
from hkserve.model.paged_pallas import PagedPast, paged_decode_attention
from hkserve.model.sampling import SamplingParams

LAYERS, HEADS, DIM, BS, POSITIONS = 2, 2, 16, 16, 64  # 4 blocks of 16 make a full table


def problem(groups: int, seed: int):
    """Random q/k/v, a static memory and its copy in a pool of shuffled blocks (plus noise blocks)."""
    rng = np.random.default_rng(seed)
    rows = 5
    q = rng.standard_normal((rows, HEADS, groups, DIM)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, HEADS, DIM)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((LAYERS, rows, POSITIONS, HEADS, DIM)).astype(np.float32) for _ in range(2))
    k_pool, table = paged_copy(k_mem, BS, 3, np.random.default_rng(seed + 1))
    v_pool, _ = paged_copy(v_mem, BS, 3, np.random.default_rng(seed + 1))
    return q, k_new, v_new, k_mem, v_mem, k_pool, v_pool, table


PAST = np.asarray([1, 16, 17, 40, POSITIONS], np.int32)  # one, a whole block, one past it, some, a full table


@pytest.mark.parametrize(
    ("groups", "window", "cap", "sinks", "splits"),
    [
        (3, 5, 30.0, True, 3),
        (4, 20, 30.0, False, 1),
        pytest.param(1, 0, 0.0, False, 1, marks=pytest.mark.slow),
        pytest.param(3, 0, 0.0, True, 2, marks=pytest.mark.slow),
    ],
)
def test_kernel_equals_float64_reference_over_shuffled_blocks(groups, window, cap, sinks, splits):
    q, k_new, v_new, k_mem, v_mem, k_pool, v_pool, table = problem(groups, seed=groups + window)
    logits = np.random.default_rng(9).standard_normal((HEADS, groups)).astype(np.float32) if sinks else None
    call = jax.jit(
        lambda layer, t: paged_decode_attention(
            q,
            k_new,
            v_new,
            PagedPast(k_pool, v_pool, layer, t, PAST, PAST, window),
            cap,
            logits,
            splits=splits,
            interpret=True,
        )
    )
    for layer in range(LAYERS):
        y = np.asarray(call(np.int32(layer), table))
        want = reference(q, k_new, v_new, k_mem, v_mem, layer, PAST, window, cap, logits)
        np.testing.assert_allclose(y, want, atol=2e-6, rtol=1e-5)
    unheld = table.copy()
    for row, n in enumerate(PAST):
        unheld[row, -(-n // BS) :] = k_pool.shape[1]  # blocks past a row's length: not held (NB)
    np.testing.assert_array_equal(np.asarray(call(np.int32(0), unheld)), np.asarray(call(np.int32(0), table)))


def test_bf16_pool_equals_float64_reference_of_the_rounded_pool():
    q, k_new, v_new, k_mem, v_mem, k_pool, v_pool, table = problem(3, seed=4)
    bf16 = (jnp.asarray(k_pool, jnp.bfloat16), jnp.asarray(v_pool, jnp.bfloat16))
    y = paged_decode_attention(q, k_new, v_new, PagedPast(*bf16, 1, table, PAST, PAST, 0), interpret=True)
    want = reference(q, k_new, v_new, bf16_rounded(k_mem), bf16_rounded(v_mem), 1, PAST, 0, 0.0)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_to_triton_for_cuda(dtype):
    """What a GPU compiles, checked here: Pallas's Triton lowering takes the kernel (power-of-two
    blocks, the dot's shapes, the loop over table entries) for SmolLM2's heads and a capped window."""
    s = jax.ShapeDtypeStruct
    rows, heads, groups, dim, pool = 16, 3, 3, 64, (30, 100, 32, 3, 64)
    args = [s((rows, heads, groups, dim), jnp.float32), *[s((rows, heads, dim), jnp.float32)] * 2]
    args += [s(pool, dtype)] * 2 + [s((), jnp.int32), s((rows, 8), jnp.int32), *[s((rows,), jnp.int32)] * 2]
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    fn = jax.jit(lambda q, k, v, *past: paged_decode_attention(q, k, v, PagedPast(*past, 7), 30.0, splits=2))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "hk_paged_decode_attention" in text


def test_dispatch_chooses_by_env_and_falls_back_with_a_log_line(monkeypatch, caplog):
    config = tiny_config()
    memory = init_paged_memory(config, 2, 8, BS, 64)
    assert decode_kernel(config, memory) is None  # auto on a CPU: the gather
    monkeypatch.setenv(KERNEL_ENV, "interpret")
    assert decode_kernel(config, memory) == "interpret"
    with caplog.at_level(logging.WARNING, "hkserve.model"):
        assert decode_kernel(config, init_paged_memory(config, 2, 8, 5, 64)) is None  # block size 5
        assert decode_kernel(config.replace(head_dim=24), memory) is None
    assert "block size 5 is not a power of two" in caplog.text and "head dim 24" in caplog.text
    monkeypatch.setenv(KERNEL_ENV, "xla")
    assert decode_kernel(config, memory) is None
    monkeypatch.setenv(KERNEL_ENV, "pallas")
    with pytest.raises(ValueError, match="needs a GPU"):
        decode_kernel(config, memory)
    monkeypatch.setenv(KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="must be one of"):
        decode_kernel(config, memory)
    monkeypatch.setenv(KERNEL_ENV, "auto")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # auto on one GPU: the kernel
    assert decode_kernel(config, memory) == "pallas"
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    with caplog.at_level(logging.WARNING, "hkserve.model"):
        assert decode_kernel(config, memory) is None  # ... and the gather on a mesh
    assert "a mesh of 2 devices" in caplog.text


def _decode_logits(config, params, env: str, monkeypatch, layers: str = "scan") -> list[np.ndarray]:
    """Prefill two rows (12 and 9 tokens) into a paged memory of shuffled blocks, then 6 decode steps
    of both rows: the logits of each step, with the paged decode attention chosen by `env`."""
    monkeypatch.setenv(KERNEL_ENV, env)
    model = build_model(config, layers=layers)
    forward = jax.jit(model.forward, static_argnames=("attend_len", "last_only"))
    memory = init_paged_memory(config, 2, 12, BS, 64)
    memory = memory._replace(table=jnp.asarray(np.random.default_rng(2).permutation(12)[:8].reshape(2, 4), jnp.int32))
    prompt = np.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 12)), np.int32)
    _, memory = forward(params, prompt, memory, np.asarray([12, 9], np.int32), attend_len=0)
    out = []
    for step in range(6):
        logits, memory = forward(params, np.full((2, 1), 3 + step, np.int32), memory, np.ones(2, np.int32))
        out.append(np.asarray(logits))
    return out


WINDOW_CAP_SINKS = {"sliding_window": 3, "sliding_layers": (True, False), "attn_logit_cap": 30.0, "attn_sinks": True}


@pytest.mark.parametrize(
    "changes",
    [
        WINDOW_CAP_SINKS,
        pytest.param({}, marks=pytest.mark.slow),
        pytest.param({"n_kv_heads": 1}, marks=pytest.mark.slow),  # 4 query heads per KV head
    ],
    ids=["sliding-capped-sinks", "gqa", "mqa"],
)
def test_model_logits_through_the_kernel_equal_the_gather_path(changes, monkeypatch):
    """The kernel (interpreted) inside the per-layer loop a GPU runs (model/layer_loop.py) against XLA's
    gather in the layer scan: the same decode logits to float32 rounding."""
    config = tiny_config(**changes)
    params = init_params(config, 5)
    if config.attn_sinks:  # learned sinks, not zeros: they must reach the kernel's softmax
        sinks = params["decoder/layers/attention"]["sinks"]
        params["decoder/layers/attention"]["sinks"] = sinks + jnp.linspace(-1.0, 2.0, sinks.size).reshape(sinks.shape)
    gather = _decode_logits(config, params, "xla", monkeypatch)
    kernel = _decode_logits(config, params, "interpret", monkeypatch, layers="loop")  # a GPU's layer loop
    for a, b in zip(gather, kernel, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-5)


def test_engine_greedy_tokens_through_the_kernel_equal_the_gather_path(monkeypatch):
    """Paged engine of a tiny model (sliding window on one layer): greedy replies, alone and beside a
    neighbour, through the Pallas kernel (interpreted) equal XLA's gather path's."""
    greedy = [TARGETS[0], Request(list(range(3, 50)), 20, SamplingParams(temperature=0.0))]
    monkeypatch.setenv(KERNEL_ENV, "xla")
    want = run(make_runner("xla", "paged", slots=2), greedy)
    monkeypatch.setenv(KERNEL_ENV, "interpret")
    assert run(make_runner("xla", "paged", slots=2), greedy) == want
