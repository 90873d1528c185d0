"""The CPU decode-attention kernel for float32/bfloat16-weight models (issue 34): `--kernels auto` gives
them an attention-only spec (kernels/dispatch.py) under which a decode step reads each row's KV memory in
place (static, or paged by block table) while the products, the params and the sampler stay XLA's; the
kernel's logits stay close to XLA's attention and its greedy tokens equal them, on both layouts.
Batch invariance and paged == static on this path: test_paged_engine.py and test_paged_attention.py;
the SmolLM2 golden cases: test_paged_smollm2.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config
from test_paged_attention import _paged, _steps

from hkserve.kernels import dispatch, ffi
from hkserve.kernels.dispatch import KernelSpec
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory
from hkserve.model.sampling import SamplingParams, make_settings, sample

CONFIG = tiny_config(sliding_window=5, sliding_layers=(True, False))
QUANTIZED_TARGETS = ("hk_w8a", "hk_w4a", "hk_w8ga", "hk_logit_stats")  # what a float model must not call


def attention_spec() -> KernelSpec:
    spec = dispatch.resolve("auto", "float32")
    assert spec is not None, "no kernel library or no AVX2 here: the float attention kernel is not tested"
    return spec


def test_float_models_get_an_attention_only_spec_and_xla_keeps_xla():
    spec = attention_spec()
    assert spec == KernelSpec(None, ffi.cpu_isa()) and spec.attention_only
    assert dispatch.resolve("auto", "bfloat16") == spec
    assert dispatch.resolve("w8a8", "float32") == spec  # a named int8 kind: nothing but attention for floats
    assert not dispatch.resolve("auto", "int8").attention_only
    assert dispatch.resolve("xla", "float32") is None  # the old path stays reachable
    assert dispatch.resolve("auto", "float32", devices=2) is None  # multi-device meshes keep XLA
    assert dispatch.resolve("auto", "float32", memory="vq") is None
    assert "decode attention only" in spec.describe()


def _lowered(config, kernels, paged: bool, layers: str = "scan") -> tuple[str, str]:
    """(decode step's, prefill's) lowered program text of `config` under `kernels` (custom calls by name)."""
    model = build_model(config, kernels, layers)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0))  # shapes suffice to lower
    memory = _paged(config, 2, 8, np.arange(8).reshape(2, 4)) if paged else init_memory(config, 2, 32)
    forward = jax.jit(model.forward, static_argnames=("attend_len", "last_only"))
    one = np.ones(2, np.int32)
    step = forward.lower(params, np.ones((2, 1), np.int32), memory, one, attend_len=32).as_text()
    prefill = forward.lower(params, np.ones((2, 4), np.int32), memory, one, attend_len=0).as_text()
    return step, prefill


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("paged", [False, True])
def test_the_float_spec_runs_decode_attention_only(paged, dtype):
    """Params as plain (nothing packed, no prepare), the decode step calls hk_decode_attention and no
    product or sampler kernel, prefill keeps XLA's attention; gpt-oss's sinks and a head size not a
    multiple of 16 keep XLA's decode attention too."""
    spec, config = attention_spec(), CONFIG.replace(dtype=dtype)
    model = build_model(config, spec)
    assert model.prepare is None and model.kernels == spec
    plain = jax.eval_shape(build_model(config).init, jax.random.PRNGKey(0))
    assert jax.eval_shape(model.init, jax.random.PRNGKey(0)) == plain
    step, prefill = _lowered(config, spec, paged)
    assert "hk_decode_attention" in step and "hk_decode_attention" not in prefill
    assert not any(t in step or t in prefill for t in QUANTIZED_TARGETS)
    assert "hk_decode_attention" not in _lowered(config, None, paged)[0]  # --kernels xla
    for other in (config.replace(attn_sinks=True), config.replace(head_dim=24)):
        assert "hk_decode_attention" not in _lowered(other, spec, paged)[0]
    assert "hk_decode_attention" in _lowered(config, spec, paged, "loop")[0]  # no stacked weights to hold: allowed
    settings = make_settings([SamplingParams(temperature=0.0)] * 2, CONFIG.vocab_size)
    logits = jnp.zeros((2, CONFIG.vocab_size), jnp.float32)
    sampler = jax.jit(lambda x: sample(x, settings, jnp.zeros(2, jnp.int32), kernels=spec).token)
    assert "hk_logit_stats" not in sampler.lower(logits).as_text()  # the sampler stays XLA's


# Measured on these configs: float32 logits (|x| <= ~3) at most 9.5e-7 apart (the kernel's exponentials
# are a ~1 ulp polynomial, its sums in another order; the products are XLA's on both sides, so this is
# attention's alone); bfloat16 weights 0 (each product's input is rounded to bf16, which absorbs it).
ATOL, RTOL = 1e-5, 0.0


@pytest.mark.parametrize(("paged", "dtype"), [(False, "float32"), (True, "float32"), (True, "bfloat16")])
def test_float_kernel_decode_logits_are_close_to_xla_and_greedy_tokens_equal(paged, dtype):
    config = CONFIG.replace(dtype=dtype)
    params = init_params(config, 5)
    tables = np.random.default_rng(3).permutation(2 * 7 * 2)[:14].reshape(2, 7)  # shuffled blocks of 5

    def memory():
        return _paged(config, 2, 5, tables) if paged else init_memory(config, 2, 32)

    xla = _steps(config, params, None, memory())
    kernel = _steps(config, params, attention_spec(), memory())
    np.testing.assert_array_equal(kernel[0], xla[0])  # prefill: XLA's attention on both sides
    for a, b in zip(kernel[1:], xla[1:], strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)
        np.testing.assert_array_equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))
