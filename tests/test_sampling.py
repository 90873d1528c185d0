"""Per-row sampling semantics on the device, and the one validation of a request's settings.

Kept fast for `make mutate`, which runs these tests once per mutant: the draws go through two compiled
shapes of `sample` ([8, V] with a history and 5 top logprobs; [1000, n] without either) and one of
`_filter`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hkserve.model.sampling import (
    InvalidSampling,
    SamplingParams,
    TokenHistory,
    _filter,
    adjust_logits,
    empty_history,
    first_argmax,
    make_settings,
    sample,
    top_k,
)

V = 50
B = 8

_sample = jax.jit(sample, static_argnums=(3,))


def logits_batch(seed: int = 0, scale: float = 3.0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, V)) * scale, jnp.float32)


def draw(logits, settings_rows, positions=None, history=None):
    """One [B, V] compiled program for every test that draws from it."""
    positions = jnp.zeros(B, jnp.int32) if positions is None else positions
    history = empty_history(B, V) if history is None else history
    settings = jax.tree_util.tree_map(jnp.asarray, make_settings(settings_rows, V))
    return _sample(logits, settings, positions, 5, history)


def test_temperature_zero_is_greedy_and_logprobs_are_log_softmax():
    logits = logits_batch()
    out = draw(logits, [SamplingParams()] * B)
    np.testing.assert_array_equal(out.token, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(out.logprob, ref[np.arange(B), out.token], atol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, np.sort(np.asarray(ref), -1)[:, ::-1][:, :5], atol=1e-6)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-np.asarray(ref), -1)[:, :5])
    assert np.all(np.exp(out.top_logprobs).sum(-1) <= 1 + 1e-6)


def test_first_argmax_is_argmax_ties_included():
    rng = np.random.default_rng(4)
    x = rng.integers(-3, 4, size=(64, 37)).astype(np.float32)  # many ties of the largest value
    x[5] = -np.inf
    x[6, 30:] = np.inf
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), np.argmax(x, -1))
    assert int(first_argmax(jnp.asarray([[np.nan, 1.0, 2.0]]))[0]) == 2  # no largest value: in range


@pytest.mark.parametrize(("v", "k"), [(49152, 5), (49152, 20), (5000, 7), (1000, 1), (300, 20)])
def test_two_stage_top_k_is_lax_top_k_ties_included(v, k):
    rng = np.random.default_rng(v + k)
    x = rng.integers(-40, 9, size=(6, v)).astype(np.float32)  # the largest values tie across chunks
    x[1] = rng.normal(size=v)
    x[2, : v // 2] = -np.inf
    x[3] = 0.0
    x[4, -3:] = 100.0  # the largest in the last, padded chunk
    want = jax.lax.top_k(jnp.asarray(x), k)
    got = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])


def test_penalties_skipped_or_run_change_no_bit_of_rows_without_them():
    """The penalties run only when some row has one: a row without them gets the same bits either way."""
    logits = logits_batch(seed=2)
    counts = jnp.asarray(np.random.default_rng(3).integers(0, 3, (B, V)), jnp.int32)
    history = TokenHistory(counts, jnp.asarray(np.random.default_rng(5).random((B, V)) < 0.3))
    plain = [SamplingParams(temperature=0.7, seed=i, logit_bias={i: 1.5}) for i in range(B)]
    penalized = plain[:-1] + [SamplingParams(temperature=0.7, seed=B, repetition_penalty=1.3, presence_penalty=0.5)]
    adjust = jax.jit(adjust_logits)
    settings = {
        name: jax.tree_util.tree_map(jnp.asarray, make_settings(rows, V))
        for name, rows in (("plain", plain), ("penalized", penalized))
    }
    skipped = np.asarray(adjust(logits, settings["plain"], history))
    run = np.asarray(adjust(logits, settings["penalized"], history))
    np.testing.assert_array_equal(skipped, np.asarray(logits + settings["plain"].logit_bias))
    np.testing.assert_array_equal(run[:-1], skipped[:-1])
    assert not np.array_equal(run[-1], skipped[-1])
    alone, among = draw(logits, plain, history=history), draw(logits, penalized, history=history)
    for field in ("token", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(among, field)[:-1], getattr(alone, field)[:-1], err_msg=field)


def test_same_seed_same_tokens_and_rows_independent_of_batch_mates():
    logits = logits_batch(seed=1)
    rows = [SamplingParams(temperature=1.0, seed=s) for s in range(B)]
    a = draw(logits, rows).token
    b = draw(logits, rows).token
    np.testing.assert_array_equal(a, b)
    # Row 3 among empty slots (default settings, other logits), as the engine holds a lone request.
    alone_logits = logits_batch(seed=9).at[3].set(logits[3])
    alone = draw(alone_logits, [SamplingParams()] * 3 + rows[3:4] + [SamplingParams()] * 4).token
    assert int(alone[3]) == int(a[3])
    other_seeds = draw(logits, [SamplingParams(temperature=1.0, seed=s + 100) for s in range(B)]).token
    assert not np.array_equal(a, other_seeds)
    later = draw(logits, rows, jnp.full(B, 1, jnp.int32)).token  # the position keys the draw too
    assert not np.array_equal(a, later)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = logits_batch(seed=2)
    greedy = np.argmax(logits, -1)
    for pos in range(5):
        positions = jnp.full(B, pos, jnp.int32)
        np.testing.assert_array_equal(
            draw(logits, [SamplingParams(temperature=1.5, top_k=1, seed=7)] * B, positions).token, greedy
        )
        np.testing.assert_array_equal(
            draw(logits, [SamplingParams(temperature=1.5, top_p=1e-6, seed=7)] * B, positions).token, greedy
        )


def test_min_p_and_top_k_restrict_the_support():
    probs = np.full(V, 0.02 / (V - 5))
    probs[:5] = [0.4, 0.3, 0.15, 0.1, 0.03]
    logits = jnp.asarray(np.tile(np.log(probs), (B, 1)), jnp.float32)
    seen_min_p, seen_top2 = set(), set()
    for pos in range(25):  # 200 draws: 8 seeds x 25 positions
        positions = jnp.full(B, pos, jnp.int32)
        min_p = [SamplingParams(temperature=1.0, min_p=0.3, seed=s) for s in range(B)]
        top2 = [SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(B)]
        seen_min_p.update(np.asarray(draw(logits, min_p, positions).token).tolist())
        seen_top2.update(np.asarray(draw(logits, top2, positions).token).tolist())
    assert seen_min_p == {0, 1, 2}  # p >= 0.3 * 0.4
    assert seen_top2 == {0, 1}


def test_sample_draws_after_bias_and_penalties_but_reports_the_model_logprobs():
    """Greedy rows take the adjusted argmax; the reported logprob is the raw model's. Ties go to the
    lowest id whatever the seed, and a sampling row's draw is not disturbed by the greedy rows beside it
    (their logits, scaled by 1 / 1e-6, are a million times larger)."""
    base = np.full(V, -30.0)
    base[:6] = [2.0, 1.0, 0.5, 0.0, -1.0, -2.0]
    tie = np.full(V, -30.0)
    tie[:2] = 1.0
    wide = np.full(V, -30.0)
    wide[:3] = [-10.0, 3.0, 3.0]
    logits = jnp.asarray(np.stack([base, base, base, tie, tie, tie, tie, wide]), jnp.float32)
    counts = np.zeros((B, V), np.int32)
    counts[2, 0] = 1  # row 2 generated token 0 once: 2 / 4 = 0.5 < 1
    history = TokenHistory(jnp.asarray(counts), jnp.zeros((B, V), bool))
    rows = [
        SamplingParams(),
        SamplingParams(logit_bias={0: -100}),
        SamplingParams(repetition_penalty=4.0),
        *(SamplingParams(seed=s) for s in range(4)),
        SamplingParams(temperature=1.0, seed=3),
    ]
    out = draw(logits, rows, history=history)
    token = np.asarray(out.token)
    assert token[:7].tolist() == [0, 1, 1, 0, 0, 0, 0]
    assert token[7] in (1, 2)
    raw = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(out.logprob, raw[np.arange(B), token], atol=1e-6)
    assert out.token.dtype == jnp.int32 and out.logprob.dtype == jnp.float32


U_IS_ONE = (3353848, 0)  # (seed, position) whose uniform draw is exactly 0.0, so u = 1 - 0 = 1


def test_a_draw_at_the_top_of_the_cdf_takes_the_last_token_with_mass():
    """u = 1 is the largest draw: it takes the last token with mass, never a masked one or an id past the
    vocabulary (no token's cumulative mass is below u times the total past that one)."""
    seed, position = U_IS_ONE
    key = jax.random.fold_in(jax.random.PRNGKey(seed), position)
    assert float(jax.random.uniform(key)) == 0.0  # found by search; a changed RNG would need another
    logits = jnp.asarray(np.tile(np.linspace(3.0, -3.0, V), (B, 1)), jnp.float32)
    rows = [SamplingParams(temperature=1.0, top_k=3, seed=seed)] + [SamplingParams()] * (B - 1)
    out = draw(logits, rows, jnp.full(B, position, jnp.int32))
    assert int(out.token[0]) == 2


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


# field → (values taken at the edges, {refused value: the exact message}).
BOUNDS = {
    "temperature": (
        [0, 100],
        {
            -0.5: "temperature must be at least 0.0 and at most 100.0, got -0.5",
            100.5: "temperature must be at least 0.0 and at most 100.0, got 100.5",
            True: "temperature must be a number, got True",
            "1": "temperature must be a number, got '1'",
        },
    ),
    "top_p": (
        [1e-9, 1],
        {
            0.0: "top_p must be greater than 0.0 and at most 1.0, got 0.0",
            1.5: "top_p must be greater than 0.0 and at most 1.0, got 1.5",
        },
    ),
    "min_p": (
        [0, 1],
        {
            -0.1: "min_p must be at least 0.0 and at most 1.0, got -0.1",
            1.5: "min_p must be at least 0.0 and at most 1.0, got 1.5",
        },
    ),
    "presence_penalty": (
        [-2, 2],
        {
            -2.5: "presence_penalty must be at least -2.0 and at most 2.0, got -2.5",
            2.5: "presence_penalty must be at least -2.0 and at most 2.0, got 2.5",
        },
    ),
    "frequency_penalty": (
        [-2, 2],
        {
            -2.5: "frequency_penalty must be at least -2.0 and at most 2.0, got -2.5",
            2.5: "frequency_penalty must be at least -2.0 and at most 2.0, got 2.5",
        },
    ),
    "repetition_penalty": (
        [1e-9, 1e6],
        {
            0: "repetition_penalty must be greater than 0.0 and at most 1000000.0, got 0",
            1e6 + 0.5: "repetition_penalty must be greater than 0.0 and at most 1000000.0, got 1000000.5",
        },
    ),
    "top_k": (
        [-1, 0, 2**31 - 1],
        {
            -2: "top_k must be in [-1, 2147483647], got -2",
            2**31: "top_k must be in [-1, 2147483647], got 2147483648",
            2.5: "top_k must be an integer, got 2.5",
            True: "top_k must be an integer, got True",
            "3": "top_k must be an integer, got '3'",
        },
    ),
    "seed": (
        [0, 2**32 - 1],
        {
            -1: "seed must be in [0, 4294967295], got -1",
            2**32: "seed must be in [0, 4294967295], got 4294967296",
        },
    ),
    "logit_bias": (
        [{0: -100, 1: 100}, {"-3": 1, "1" * 18: 2}],  # ids past the vocabulary are check_vocab's to refuse
        {
            (1,): "logit_bias must map token ids to biases, got (1,)",
            "{x": "logit_bias must map token ids to biases, got '{x'",
            # keys: ASCII digits only, at most 18 of them (int() of anything longer is refused, not slow)
            "a": "logit_bias keys must be token ids, got 'a'",
            "1" * 19: "logit_bias keys must be token ids, got '1111111111111111111'",
            "²": "logit_bias keys must be token ids, got '²'",
            True: "logit_bias keys must be token ids, got True",
            1.5: "logit_bias keys must be token ids, got 1.5",
            "k" * 24: f"logit_bias keys must be token ids, got '{'k' * 24}'",
            "k" * 25: f"logit_bias keys must be token ids, got '{'k' * 24}...'",
            # values
            -100.5: "logit_bias values must be in [-100, 100], got -100.5",
            100.5: "logit_bias values must be in [-100, 100], got 100.5",
            "v": "logit_bias values must be in [-100, 100], got '1'",
            "b": "logit_bias values must be in [-100, 100], got True",
        },
    ),
}
# logit_bias's refused values above, keyed apart: a mapping, or the key or value its message names.
BAD_BIAS = {
    (1,): (1,),
    "{x": "{x",
    "a": {"a": 1},
    "1" * 19: {"1" * 19: 1},
    "²": {"²": 1},
    True: {True: 1},
    1.5: {1.5: 1},
    "k" * 24: {"k" * 24: 1},
    "k" * 25: {"k" * 25: 1},
    -100.5: {3: -100.5},
    100.5: {3: 100.5},
    "v": {3: "1"},
    "b": {3: True},
}


@pytest.mark.parametrize("name", BOUNDS)
def test_each_bound_is_taken_at_its_edge_and_refused_past_it_with_its_message(name):
    taken, refused = BOUNDS[name]
    for value in taken:
        SamplingParams(**{name: value})
    for value, message in refused.items():
        given = BAD_BIAS[value] if name == "logit_bias" else value
        with pytest.raises(InvalidSampling) as caught:
            SamplingParams(**{name: given})
        assert (caught.value.param, str(caught.value)) == (name, message)


def test_sampling_params_store_each_field_in_its_device_type():
    params = SamplingParams(
        temperature=1,
        top_p=1,
        top_k=3.0,
        min_p=0,
        presence_penalty=1,
        frequency_penalty=-1,
        repetition_penalty=2,
        seed=5.0,
        logit_bias={"7": 1, 3: -2},
    )
    stored = {name: (type(value), value) for name, value in vars(params).items()}
    assert stored == {
        "temperature": (float, 1.0),
        "top_p": (float, 1.0),
        "top_k": (int, 3),
        "min_p": (float, 0.0),
        "presence_penalty": (float, 1.0),
        "frequency_penalty": (float, -1.0),
        "repetition_penalty": (float, 2.0),
        "seed": (int, 5),
        "logit_bias": (dict, {7: 1.0, 3: -2.0}),
    }
    assert [type(v) for v in params.logit_bias.values()] == [float, float]
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=0).top_k == 0


def test_check_vocab_names_the_first_id_outside_the_vocabulary():
    SamplingParams(logit_bias={0: 1, 4: 1}).check_vocab(5)
    for bias, bad in [({5: 1}, 5), ({-1: 1}, -1), ({2: 1, 7: 1, 9: 1}, 7)]:
        with pytest.raises(InvalidSampling) as caught:
            SamplingParams(logit_bias=bias).check_vocab(5)
        assert caught.value.param == "logit_bias"
        assert str(caught.value) == f"logit_bias token id {bad} is outside the vocabulary (0..4)"


def test_make_settings_lays_out_one_typed_row_per_request():
    rows = [
        SamplingParams(
            temperature=0.5,
            top_p=0.9,
            top_k=3,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.5,
            seed=2**32 - 1,
            logit_bias={1: 2.0, 4: -100},
        ),
        SamplingParams(),
    ]
    settings = make_settings(rows, 5)
    expected = {
        "temperature": ([0.5, 0.0], np.float32),
        "top_p": ([0.9, 1.0], np.float32),
        "top_k": ([3, 0], np.int32),
        "min_p": ([0.1, 0.0], np.float32),
        "presence_penalty": ([0.5, 0.0], np.float32),
        "frequency_penalty": ([-0.5, 0.0], np.float32),
        "repetition_penalty": ([1.5, 1.0], np.float32),
        "seed": ([2**32 - 1, 0], np.uint32),
        "logit_bias": ([[0, 2, 0, 0, -100], [0, 0, 0, 0, 0]], np.float32),
    }
    for name, (values, dtype) in expected.items():
        column = getattr(settings, name)
        assert column.dtype == dtype, name
        np.testing.assert_array_equal(column, np.asarray(values, dtype), err_msg=name)
    with pytest.raises(InvalidSampling, match=r"token id 5 is outside the vocabulary \(0..4\)"):
        make_settings([SamplingParams(), SamplingParams(logit_bias={5: 1})], 5)


def test_empty_history_has_no_tokens():
    history = empty_history(2, 5)
    assert (history.counts.shape, history.counts.dtype) == ((2, 5), jnp.int32)
    assert (history.in_prompt.shape, history.in_prompt.dtype) == ((2, 5), jnp.bool_)
    assert not history.counts.any() and not history.in_prompt.any()


def test_bias_then_repetition_frequency_and_presence_penalties_exactly():
    """Hand-computed. Row 0: repetition 2, frequency 0.5, presence 0.25. Token 0 and 1 are in the
    prompt only, token 2 was generated twice, token 4 once (its bias of -2 applies first, so it is
    penalised as a negative logit), token 3 and 5 are unseen (5 keeps its +0.5 bias). Row 1: only a
    frequency penalty of -0.5 and a presence penalty of 1, on token 3 generated three times."""
    logits = jnp.asarray([[3.0, -3.0, 1.0, 0.5, 1.0, 2.0]] * 2, jnp.float32)
    settings = make_settings(
        [
            SamplingParams(
                repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: -2, 5: 0.5}
            ),
            SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0),
        ],
        6,
    )
    history = TokenHistory(
        counts=jnp.asarray([[0, 0, 2, 0, 1, 0], [0, 0, 0, 3, 0, 0]], jnp.int32),
        in_prompt=jnp.asarray([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool),
    )
    expected = [
        [3 / 2, -3 * 2, 1 / 2 - 2 * 0.5 - 0.25, 0.5, (1 - 2) * 2 - 0.5 - 0.25, 2.5],
        [3.0, -3.0, 1.0, 0.5 + 0.5 * 3 - 1.0, 1.0, 2.0],
    ]
    np.testing.assert_allclose(adjust_logits(logits, settings, history), expected, rtol=0, atol=1e-6)
    no_history = adjust_logits(logits, settings, None)  # without a history: the bias only
    np.testing.assert_allclose(no_history, [[3.0, -3.0, 1.0, 0.5, -1.0, 2.5], [3.0, -3.0, 1.0, 0.5, 1.0, 2.0]])


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


# (logits, (top_k, top_p, min_p)) → the tokens that stay, at the edges of the thresholds' bisection.
# Row 0's range is two million: each row must bracket its own threshold, since bisecting row 1 over
# that range would not separate logits 1e-5 apart.
EDGE_CASES = [
    ([1e6, -1e6, 0, 0, 0, 0], (0, 1.0, 0.0), [0, 1, 2, 3, 4, 5]),  # neutral keeps zero-mass tokens too
    ([1.0, 1.0 - 1e-5, -1, -1, -1, -1], (1, 1.0, 0.0), [0]),
    ([1.0, 1.0 - 5e-7, -1, -1, -1, -1], (1, 1.0, 0.0), [0]),  # 4 float32 steps below the top logit
    ([1.0, 1.0 - 5e-7, -1, -1, -1, -1], (2, 1.0, 0.0), [0, 1]),
    ([1.0, 1.0 - 2**-24, -1, -1, -1, -1], (1, 1.0, 0.0), [0]),  # the next float32 below the top logit
    # Rows with masked (-inf) tokens, as a grammar mask or a -100 bias leaves them: top-k counts only the rest.
    ([3, 2, 1, -np.inf, 0, -1], (2, 1.0, 0.0), [0, 1]),
    ([-np.inf, 2, -np.inf, 1, 0, -np.inf], (5, 1.0, 0.0), [1, 3, 4]),  # k above the allowed count keeps them all
    ([-np.inf, *np.log([0.5, 0.3, 0.2]), -np.inf, -np.inf], (0, 0.7, 0.0), [1, 2]),
]


_filter_jit = jax.jit(_filter)


def filtered_rows() -> np.ndarray:
    """_filter over FILTER_CASES, then EDGE_CASES, as one batch (one compiled program, which each test
    calls itself: `make mutate` maps a function to the tests that call it)."""
    cases = [(np.log(PROBS), case) for case, _ in FILTER_CASES] + [(row, case) for row, case, _ in EDGE_CASES]
    logits = jnp.asarray(np.stack([row for row, _ in cases]), jnp.float32)
    top_k, top_p, min_p = (np.asarray(column) for column in zip(*(case for _, case in cases)))
    return np.asarray(_filter_jit(logits, jnp.float32(top_p), jnp.int32(top_k), jnp.float32(min_p)))


def test_filters_keep_exactly_the_expected_tokens_renormalised():
    """top-k, then top-p on the renormalised rest, then min-p, for each row of one batch."""
    for row, ((k, p, m), kept) in zip(filtered_rows(), FILTER_CASES):
        assert np.flatnonzero(np.isfinite(row)).tolist() == kept, (k, p, m)
        expected = np.zeros_like(PROBS)
        expected[kept] = PROBS[kept] / PROBS[kept].sum()
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(row)), expected, atol=1e-6, err_msg=str((k, p, m)))


def test_filter_thresholds_are_per_row_and_exact_to_the_float():
    rows = filtered_rows()[len(FILTER_CASES) :]
    for row, (logits, case, kept) in zip(rows, EDGE_CASES):
        assert np.flatnonzero(np.isfinite(row)).tolist() == kept, (logits, case)
        np.testing.assert_array_equal(row[kept], np.float32(logits)[kept])


def _frequencies(logits_row, settings: dict, draws: int = 1000) -> np.ndarray:
    """How often each token comes out of `sample` over `draws` rows with seeds 0..draws-1."""
    logits = jnp.asarray(np.tile(logits_row, (draws, 1)), jnp.float32)
    rows = make_settings([SamplingParams(**{**settings, "seed": s}) for s in range(draws)], logits.shape[-1])
    out = _sample(logits, rows, jnp.zeros(draws, jnp.int32))  # n_top left at its default: none
    assert out.top_ids.shape == out.top_logprobs.shape == (draws, 0)
    assert out.top_ids.dtype == jnp.int32 and out.top_logprobs.dtype == jnp.float32
    tokens = np.asarray(out.token)
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
