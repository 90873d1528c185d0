"""The Pallas int4 matmul (hkserve/model/int4_pallas.py), run in Pallas's interpreter on the CPU: against a
float64 reference of the same quantization at odd sizes and B in {1, 3, 16, 17}, lowered to Triton for
CUDA, chosen by its dispatch with its fallbacks, and through a tiny int4 model: XLA's logits."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config
from jax import export
from test_int4_model import logits

from hkserve.checkpoint.quantize import convert_params
from hkserve.model.int4 import dequantize, quantize_int4
from hkserve.model.int4_pallas import KERNEL_ENV, int4_matmul, kernel_choice


def problem(rows: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    weight = quantize_int4(rng.standard_normal((k, n)).astype(np.float32))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(weight).astype(np.float64)[:k]  # the same quantization, float64
    return x, jax.tree.map(jnp.asarray, weight), want


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 16), (3, 70, 48), (16, 576, 64), (17, 200, 160)])
def test_kernel_equals_a_float64_reference_of_the_same_quantization(rows, k, n):
    x, weight, want = problem(rows, k, n, seed=rows * 1000 + k + n)
    got = np.asarray(int4_matmul(jnp.asarray(x), *weight, dtype=jnp.float32, interpret=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # bfloat16 operands (the GPU's): the weights and x rounded to 8 bits of mantissa, summed in float32
    half = np.asarray(int4_matmul(jnp.asarray(x), *weight, interpret=True))
    assert np.abs(half - want).max() <= 2e-2 * np.abs(want).max()


def test_leading_dims_and_a_row_count_past_a_power_of_two():
    x, weight, want = problem(2 * 9, 96, 32, seed=5)
    got = int4_matmul(jnp.asarray(x.reshape(2, 9, 96)), *weight, dtype=jnp.float32, interpret=True)
    assert got.shape == (2, 9, 32)
    np.testing.assert_allclose(np.asarray(got).reshape(18, 32), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_kernel_lowers_to_triton_for_cuda():
    """What a GPU compiles, checked here: Pallas's Triton lowering takes the kernel at SmolLM2's MLP shape
    (K = 576: the whole-array refs need no power-of-two K) and a Llama 1B one."""
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    s = jax.ShapeDtypeStruct
    for rows, k, n in ((1, 576, 1536), (64, 2048, 8192)):
        args = (s((rows, k), jnp.float32), s((k // 2, n), jnp.uint8), *[s((k // 32, n), jnp.float32)] * 2)
        fn = jax.jit(lambda x, w, scale, low: int4_matmul(x, w, scale, low))
        text = export.export(fn, platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()
        assert "__gpu$xla.gpu.triton" in text and "hk_int4_matmul" in text


def test_dispatch_chooses_by_env_and_falls_back_with_a_log_line(monkeypatch, caplog):
    assert kernel_choice((32, 64)) is None  # auto: XLA's dot until timed on a GPU
    monkeypatch.setenv(KERNEL_ENV, "interpret")
    assert kernel_choice((32, 64)) == "interpret"
    with caplog.at_level(logging.WARNING, "hkserve.model"):
        assert kernel_choice((32, 24)) is None
        assert kernel_choice((2, 32, 64)) is None
    assert "N = 24 is not a multiple of 16" in caplog.text and "a stacked weight" in caplog.text
    monkeypatch.setenv(KERNEL_ENV, "xla")
    assert kernel_choice((32, 64)) is None
    monkeypatch.setenv(KERNEL_ENV, "pallas")
    with pytest.raises(ValueError, match="needs a GPU"):
        kernel_choice((32, 64))
    monkeypatch.setenv(KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="must be one of"):
        kernel_choice((32, 64))


def test_an_int4_model_through_the_kernel_gives_xlas_logits(monkeypatch):
    base = tiny_config(dim=80, tie_embeddings=False)  # dim 80: each input's last group is partial
    master = jax.tree_util.tree_map(np.asarray, init_params(base, 0))
    config, params = convert_params(master, base, "int4")
    tokens = np.random.default_rng(0).integers(0, 128, (2, 7)).astype(np.int32)
    xla = logits(config, params, tokens)
    monkeypatch.setenv(KERNEL_ENV, "interpret")
    kernel = logits(config, params, tokens)
    np.testing.assert_allclose(kernel, xla, rtol=1e-4, atol=1e-4 * np.abs(xla).max())
    assert (kernel.argmax(-1) == xla.argmax(-1)).all()
