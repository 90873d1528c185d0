"""Per-row sampling semantics on the device, and the one validation of a request's settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hkserve.model.sampling import InvalidSampling, SamplingParams, make_settings, sample

V = 50


_sample = jax.jit(sample, static_argnums=(3,))


def logits_batch(rows: int, seed: int = 0, scale: float = 3.0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, V)) * scale, jnp.float32)


def draw(logits, settings_rows, positions=None):
    positions = jnp.zeros(logits.shape[0], jnp.int32) if positions is None else positions
    return _sample(
        logits, jax.tree_util.tree_map(jnp.asarray, make_settings(settings_rows, logits.shape[-1])), positions, 5
    )


def test_temperature_zero_is_greedy_and_logprobs_are_log_softmax():
    logits = logits_batch(4)
    out = draw(logits, [SamplingParams()] * 4)
    np.testing.assert_array_equal(out.token, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(out.logprob, ref[np.arange(4), out.token], atol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, np.sort(np.asarray(ref), -1)[:, ::-1][:, :5], atol=1e-6)
    assert np.all(np.exp(out.top_logprobs).sum(-1) <= 1 + 1e-6)


def test_same_seed_same_tokens_and_rows_independent_of_batch_mates():
    logits = logits_batch(8, seed=1)
    rows = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    a = draw(logits, rows).token
    b = draw(logits, rows).token
    np.testing.assert_array_equal(a, b)
    alone = draw(logits[3:4], rows[3:4]).token
    assert int(alone[0]) == int(a[3])
    other_seeds = draw(logits, [SamplingParams(temperature=1.0, seed=s + 100) for s in range(8)]).token
    assert not np.array_equal(a, other_seeds)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = logits_batch(6, seed=2)
    greedy = np.argmax(logits, -1)
    for pos in range(5):
        positions = jnp.full(6, pos, jnp.int32)
        np.testing.assert_array_equal(
            draw(logits, [SamplingParams(temperature=1.5, top_k=1, seed=7)] * 6, positions).token, greedy
        )
        np.testing.assert_array_equal(
            draw(logits, [SamplingParams(temperature=1.5, top_p=1e-6, seed=7)] * 6, positions).token, greedy
        )


def test_min_p_and_top_k_restrict_the_support():
    probs = np.full(V, 0.02 / (V - 5))
    probs[:5] = [0.4, 0.3, 0.15, 0.1, 0.03]
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    seen_min_p, seen_top2 = set(), set()
    for pos in range(200):
        positions = jnp.asarray([pos], jnp.int32)
        seen_min_p.add(int(draw(logits, [SamplingParams(temperature=1.0, min_p=0.3, seed=1)], positions).token[0]))
        seen_top2.add(int(draw(logits, [SamplingParams(temperature=1.0, top_k=2, seed=1)], positions).token[0]))
    assert seen_min_p == {0, 1, 2}  # p >= 0.3 * 0.4
    assert seen_top2 == {0, 1}


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 2**31),  # past int32
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("seed", 2**32),  # past uint32
        ("seed", -1),
        ("seed", "7"),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {5: 300.0}),
    ],
)
def test_sampling_params_refuse_what_the_device_cannot_hold(field, value):
    with pytest.raises(InvalidSampling, match=field) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field and isinstance(caught.value, ValueError)


def test_sampling_params_read_json_and_override_only_given_fields():
    base = SamplingParams(temperature=0.5, seed=3)
    line = {"top_k": -1, "seed": None, "logit_bias": {"5": -100}, "prompt": "unrelated"}
    params = base.with_overrides(line)
    assert params == SamplingParams(temperature=0.5, seed=3, top_k=0, logit_bias={5: -100.0})
    with pytest.raises(InvalidSampling, match="outside the vocabulary"):
        params.check_vocab(5)
