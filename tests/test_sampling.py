"""Per-row sampling semantics on the device, and the one validation of a request's settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hkserve.model.sampling import InvalidSampling, SamplingParams, _filter, make_settings, sample

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


# A hand-made distribution without ties; its cumulative mass is 0.4, 0.65, 0.8, 0.9, 0.96, 1.
PROBS = np.asarray([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])

# (top_k, top_p, min_p) → the tokens that stay. Each top_p sits between two cumulative masses, so the
# kept set is the smallest prefix whose mass reaches top_p, with no rounding question at the edge.
FILTER_CASES = [
    ((0, 1.0, 0.0), [0, 1, 2, 3, 4, 5]),  # neutral: nothing masked
    ((0, 0.3, 0.0), [0]),
    ((0, 0.5, 0.0), [0, 1]),
    ((0, 0.6, 0.0), [0, 1]),
    ((0, 0.7, 0.0), [0, 1, 2]),
    ((0, 0.85, 0.0), [0, 1, 2, 3]),
    ((0, 0.95, 0.0), [0, 1, 2, 3, 4]),
    ((2, 1.0, 0.0), [0, 1]),
    ((2, 0.95, 0.0), [0, 1]),  # top-k binds first
    # top-p works on the top-k renormalised rest (0.5, 0.3125, 0.1875): 0.75 needs two tokens there,
    # where on the unfiltered distribution (0.4, 0.65, 0.8) it would need three
    ((3, 0.75, 0.0), [0, 1]),
    ((4, 0.95, 0.0), [0, 1, 2, 3]),  # renormalised top-4 mass: 0.44, 0.72, 0.89, 1
    ((0, 1.0, 0.2), [0, 1, 2, 3]),  # min-p: p >= 0.2 * 0.4
    ((0, 0.7, 0.5), [0, 1]),  # min-p (p >= 0.2) is stricter than top-p here
    ((3, 1.0, 0.5), [0, 1]),  # min-p relative to the top token after top-k
]


def test_filters_keep_exactly_the_expected_tokens_renormalised():
    """top-k, then top-p on the renormalised rest, then min-p, for each row of one batch."""
    logits = jnp.asarray(np.tile(np.log(PROBS), (len(FILTER_CASES), 1)), jnp.float32)
    top_k, top_p, min_p = (jnp.asarray(column) for column in zip(*(case for case, _ in FILTER_CASES)))
    filtered = np.asarray(jax.jit(_filter)(logits, top_p, top_k.astype(jnp.int32), min_p))
    for row, ((k, p, m), kept) in zip(filtered, FILTER_CASES):
        assert np.flatnonzero(np.isfinite(row)).tolist() == kept, (k, p, m)
        expected = np.zeros_like(PROBS)
        expected[kept] = PROBS[kept] / PROBS[kept].sum()
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(row)), expected, atol=1e-6, err_msg=str((k, p, m)))


def _frequencies(logits_row, settings: dict, draws: int = 1000) -> np.ndarray:
    """How often each token comes out of `sample` over `draws` rows with seeds 0..draws-1."""
    logits = jnp.asarray(np.tile(logits_row, (draws, 1)), jnp.float32)
    rows = make_settings([SamplingParams(**{**settings, "seed": s}) for s in range(draws)], logits.shape[-1])
    tokens = np.asarray(_sample(logits, rows, jnp.zeros(draws, jnp.int32), 0).token)
    return np.bincount(tokens, minlength=logits.shape[-1]) / draws


# (settings, expected token probabilities) on the logits log(0.5, 0.3, 0.2). min-p acts on the
# temperature-scaled distribution: 0.5 keeps tokens with p >= 0.5 * p_max after scaling.
MIN_P_TEMPERATURE_CASES = [
    ({"temperature": 1.0}, [0.5, 0.3, 0.2]),
    ({"temperature": 1.0, "min_p": 0.5}, [0.625, 0.375, 0.0]),  # 0.2 < 0.25
    ({"temperature": 0.5, "min_p": 0.5}, [1.0, 0.0, 0.0]),  # p ∝ (0.25, 0.09, 0.04): 0.09 < 0.125
    ({"temperature": 2.0, "min_p": 0.5}, np.sqrt([0.5, 0.3, 0.2]) / np.sqrt([0.5, 0.3, 0.2]).sum()),  # all stay
]


@pytest.mark.parametrize("settings,expected", MIN_P_TEMPERATURE_CASES)
def test_min_p_applies_to_the_temperature_scaled_distribution(settings, expected):
    """Seeded draws: the support is exact, frequencies within 0.05 (4σ at 1000 draws); fixed seeds, so
    the outcome is the same on every run."""
    freq = _frequencies(np.log([0.5, 0.3, 0.2]), settings)
    assert np.flatnonzero(freq).tolist() == np.flatnonzero(expected).tolist()
    np.testing.assert_allclose(freq, expected, atol=0.05)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (0, 0.85), (3, 0.75)])
def test_sample_draws_from_the_top_k_top_p_renormalised_distribution(top_k, top_p):
    (kept,) = [kept for (k, p, m), kept in FILTER_CASES if (k, p, m) == (top_k, top_p, 0.0)]
    expected = np.zeros_like(PROBS)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    freq = _frequencies(np.log(PROBS), {"temperature": 1.0, "top_k": top_k, "top_p": top_p})
    assert np.flatnonzero(freq).tolist() == kept
    np.testing.assert_allclose(freq, expected, atol=0.05)
