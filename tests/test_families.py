"""Every HF fixture family (Llama, Llama 3 RoPE, Mixtral, Qwen2, Qwen3, Mistral sliding window, Gemma 2,
Gemma 3, Phi-3) against the logits transformers computed: full forward, the cached path (prefill then one
token at a time through the KV memory, past the sliding windows), and greedy decoding through the Engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from family_fixtures import HF, fixture, full_logits, jitted_forward, reference

from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.quantize import convert_params
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model, param_shapes
from hkserve.model.memory import init_memory
from hkserve.model.sharding import param_specs, parse_mesh

TOL = 1e-4
PREFIX = 4  # the cached path prefills this many tokens, then decodes the rest one by one


def full_and_cached_logits(model, params, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([B, T, V] of one forward over all of ids, [B, T, V] of prefilling ids[:, :PREFIX] and then
    decoding one token per step through the memory). The prefill is the full forward's compile with
    lengths PREFIX: the padding after it is neither written nor read."""
    b, t = ids.shape
    forward = jitted_forward(model)
    empty = init_memory(model.config, b, 16)
    full, _ = forward(params, ids, empty, np.full(b, t, np.int32), None, 16, False)
    logits, memory = forward(params, ids, empty, np.full(b, PREFIX, np.int32), None, 16, False)
    rows = [np.asarray(logits)[:, :PREFIX]]
    for pos in range(PREFIX, t):
        logits, memory = forward(params, ids[:, pos : pos + 1], memory, np.ones(b, np.int32), None, 16, False)
        rows.append(np.asarray(logits))
    np.testing.assert_array_equal(memory.step, [t] * b)
    return np.asarray(full), np.concatenate(rows, axis=1)


def engine_greedy(model, params, prompt: list[int], n: int) -> list[int]:
    runner = InferenceRunner(Engine(model, params, EngineOptions(slots=1, max_len=32, prefill_buckets=(8,)))).start(
        warmup=False
    )
    try:
        return [t.id for t in runner.generate(Request(prompt, n))]
    finally:
        runner.stop()


@pytest.mark.parametrize("name", HF)
def test_full_cached_and_engine_greedy_match_transformers(name):
    ref = reference(name)
    config, params = load_hf(fixture("hf", name))
    model = build_model(config)
    ids = np.asarray(ref["input_ids"], np.int32)
    want = np.asarray(ref["logits"], np.float32)
    full, cached = full_and_cached_logits(model, params, ids)
    print(f"{name}: full {np.abs(full - want).max():.2e}, cached {np.abs(cached - want).max():.2e}")
    np.testing.assert_allclose(full, want, atol=TOL, rtol=0, err_msg="full forward")
    np.testing.assert_allclose(cached, want, atol=TOL, rtol=0, err_msg="cached path")
    assert engine_greedy(model, params, ref["greedy_prompt"], len(ref["greedy_ids"])) == ref["greedy_ids"]


@pytest.mark.parametrize(("name", "dtype"), [("tiny-qwen2", "int8"), ("tiny-gemma3", "bfloat16")])
def test_weight_variants_and_sharding_rules_cover_biases_and_qk_norms(name, dtype):
    """q/k/v biases (Qwen2) and q/k norms (Gemma 3) in the int8 and bf16 variants and the partition rules."""
    config, params = load_hf(fixture("hf", name))
    variant_config, variant = convert_params(params, config, dtype)
    attention = {k: v for k, v in variant.items() if "attention" in k}
    if config.qkv_bias:
        assert attention["decoder/layers/attention/q_proj"]["b"].dtype == (np.float32 if dtype == "int8" else dtype)
    if config.qk_norm:
        assert attention["decoder/layers/attention/q_norm"]["scale"].dtype == (np.float32 if dtype == "int8" else dtype)
    ref = reference(name)
    got = full_logits(build_model(variant_config), variant, ref["input_ids"])
    np.testing.assert_allclose(got, np.asarray(ref["logits"]), atol=5e-2, rtol=0)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 4).reshape(2, 2), ("data", "model"))
    specs = param_specs(param_shapes(variant_config), mesh, variant_config)  # raises for a param without rule
    assert specs["decoder/layers/attention/q_proj"]["w"] == jax.sharding.PartitionSpec(None, None, "model")
    assert set(specs) == set(param_shapes(variant_config))
    param_specs(param_shapes(config), parse_mesh("1x1"), config)


def test_final_logit_soft_cap_is_applied():
    """The fixture's logits stay far below Gemma 2's cap of 30 (tanh is then within 1e-4 of the identity),
    so the cap is checked here with a cap the logits reach."""
    config, params = load_hf(fixture("hf", "tiny-gemma2"))
    ids = reference("tiny-gemma2")["input_ids"]
    uncapped = full_logits(build_model(config.replace(final_logit_cap=0.0)), params, ids)
    capped = full_logits(build_model(config.replace(final_logit_cap=0.25)), params, ids)
    assert np.abs(uncapped).max() > 0.5
    np.testing.assert_allclose(capped, 0.25 * np.tanh(uncapped / 0.25), atol=1e-5, rtol=0)
