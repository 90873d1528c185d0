"""The CPU logit-statistics kernel (hkserve/kernels/logits.cc) against a float64 numpy reference, a
row's results alone vs among others, and the sampler with it against the sampler without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hkserve.kernels import dispatch, ffi
from hkserve.model.sampling import SamplingParams, TokenHistory, make_settings, sample


def chunk_maxima(x: np.ndarray, chunk: int) -> np.ndarray:
    """The largest value of each `chunk` values of each row (-inf past the row's end; NaN where a chunk has
    one): sampling.top_k's first stage."""
    b, v = x.shape
    n = -(-v // chunk)
    return np.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=-np.inf).reshape(b, n, chunk).max(-1)


def reference(x: np.ndarray, bias: np.ndarray):
    """row max, log sum exp(x - max) in float64, and the first index of the largest float32 x + bias; a row
    with a NaN: NaN, NaN, V - 1."""
    b, v = x.shape
    row_max = np.full(b, np.nan, np.float32)
    log_total = np.full(b, np.nan)
    greedy = np.full(b, v - 1, np.int32)
    for i in range(b):
        if np.isnan(x[i]).any():
            continue
        row_max[i] = x[i].max()
        greedy[i] = np.argmax(x[i] + bias[i])  # float32 sums, as the kernel adds; argmax takes the first
        if np.isfinite(row_max[i]):
            log_total[i] = np.log(np.exp(x[i].astype(np.float64) - row_max[i]).sum())
    return row_max, log_total, greedy


def logits_with_edge_rows(b: int, v: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian rows (scale 4) and, where the batch has room: a NaN, an all -inf row, all-equal values, the
    largest value twice (the first must win), a bias that moves the argmax, a row spread over 1e4."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    bias = np.zeros((b, v), np.float32)
    bias[0, rng.integers(0, v, 3)] = rng.uniform(-100, 100, 3).astype(np.float32)
    edits = [
        lambda r: r.__setitem__(v // 2, np.nan),
        lambda r: r.fill(-np.inf),
        lambda r: r.fill(1.5),
        lambda r: r.__setitem__([v // 3, v - 1], 50.0),
        lambda r: r.__setitem__(slice(None), np.linspace(-1e4, 10, v, dtype=np.float32)[::-1]),
    ]
    for row, edit in zip(range(1, b), edits, strict=False):
        edit(x[row])
    if b > 6:
        bias[6, v - 1] = 100.0  # the bias decides this row's token
    return x, bias


@pytest.mark.parametrize(("b", "v"), [(1, 49152), (7, 17), (16, 1000), (2, 5), (17, 8), (6, 4099), (1, 262144)])
def test_logit_stats_equal_the_float64_reference(b, v):
    x, bias = logits_with_edge_rows(b, v, seed=b * v)
    row_max, log_total, greedy, maxima = map(np.asarray, jax.jit(ffi.logit_stats)(x, bias))
    want_max, want_total, want_greedy = reference(x, bias)
    np.testing.assert_array_equal(maxima, chunk_maxima(x, 256))
    np.testing.assert_array_equal(row_max, want_max)
    np.testing.assert_array_equal(greedy, want_greedy)
    np.testing.assert_array_equal(np.isnan(log_total), np.isnan(want_total))
    np.testing.assert_allclose(log_total, want_total, atol=2e-6, rtol=2e-7)


@pytest.mark.parametrize("chunk", [8, 24, 1000])
def test_chunk_maxima_at_any_chunk_size(chunk):
    """Chunks that do not divide V (a short last one), with the edge rows' NaN, -inf and ties."""
    x, bias = logits_with_edge_rows(6, 4099, seed=chunk)
    maxima = jax.jit(ffi.logit_stats, static_argnames="chunk")(x, bias, chunk=chunk)[3]
    np.testing.assert_array_equal(np.asarray(maxima), chunk_maxima(x, chunk))
    with pytest.raises(Exception, match="multiple of 8"):
        jax.jit(ffi.logit_stats, static_argnames="chunk")(x, bias, chunk=12)[0].block_until_ready()


def test_a_rows_stats_do_not_depend_on_the_other_rows():
    x, bias = logits_with_edge_rows(9, 3001, seed=3)
    call = jax.jit(ffi.logit_stats)
    together = [np.asarray(a) for a in call(x, bias)]
    for i in range(9):
        alone = [np.asarray(a) for a in call(x[i : i + 1], bias[i : i + 1])]
        for a, t in zip(alone, together, strict=True):
            np.testing.assert_array_equal(a[0], t[i])


ROWS = {  # what each of a batch's rows asks; the sampler's branches run when some row needs them
    "greedy": [SamplingParams()] * 4,
    "biased": [SamplingParams(logit_bias={5: 100.0}), SamplingParams(), SamplingParams(logit_bias={9: -100.0})] * 2,
    "penalized": [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(frequency_penalty=0.7)],
    "penalized-sampling": [
        SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5),
        SamplingParams(repetition_penalty=1.3, logit_bias={11: 50.0}),
        SamplingParams(temperature=1.0, seed=9),
    ],
    "sampling": [
        SamplingParams(temperature=0.8, seed=3, top_k=20),
        SamplingParams(),
        SamplingParams(temperature=1.2, logit_bias={7: 100.0}),
    ],
}


@pytest.mark.parametrize("vocab", [3000, 6000])  # 6000: 24 chunks, top_k takes the kernel's chunk maxima
@pytest.mark.parametrize("rows", list(ROWS))
def test_sample_with_the_kernel_equals_sample_without(rows, vocab):
    settings = jax.tree_util.tree_map(jnp.asarray, make_settings(ROWS[rows], vocab))
    b = settings.temperature.shape[0]
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal((b, vocab)) * 3, jnp.float32)
    counts = rng.integers(0, 3, (b, vocab)) * (rng.random((b, vocab)) < 0.01)
    np.put_along_axis(counts, np.argsort(-np.asarray(logits), axis=-1)[:, :3], 2, axis=-1)  # penalties bite
    history = TokenHistory(jnp.asarray(counts, jnp.int32), jnp.asarray(rng.random((b, vocab)) < 0.01))
    positions = jnp.arange(b, dtype=jnp.int32) + 7
    spec = dispatch.KernelSpec("w8a16", ffi.cpu_isa())

    def run(kernels):
        fn = jax.jit(lambda lg: sample(lg, settings, positions, 5, history, None, kernels))
        out = fn(logits)
        return out, fn.lower(logits).compile().as_text()

    (plain, _), (kernel, hlo) = run(None), run(spec)
    assert "hk_logit_stats" in hlo
    np.testing.assert_array_equal(np.asarray(kernel.token), np.asarray(plain.token))
    np.testing.assert_array_equal(np.asarray(kernel.top_ids), np.asarray(plain.top_ids))
    np.testing.assert_allclose(np.asarray(kernel.logprob), np.asarray(plain.logprob), atol=2e-6)
    np.testing.assert_allclose(np.asarray(kernel.top_logprobs), np.asarray(plain.top_logprobs), atol=2e-6)
