"""One Transformer-VQ GAU: the reference implementation's numbers (fixtures/vq) and exactness of the
cached linear-time form against the quadratic reference for any split into blocks."""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import require_fixtures
from vq_reference import reference_gau

from hkserve.model.config import ModelConfig
from hkserve.model.vq_attention import GAU, attend, quantize
from hkserve.model.vq_memory import GAUState, advance

ATOL, RTOL = 1e-5, 1e-4


def empty_state(config: ModelConfig, batch: int) -> GAUState:
    h, m, s, dv = config.n_heads, config.vq_mem_len, config.vq_codes, config.vq_value_dim
    return GAUState(
        jnp.full((batch, h, m), s, jnp.int32),
        jnp.zeros((batch, h, m, dv)),
        jnp.zeros((batch, h, s)),
        jnp.zeros((batch, h, s, dv)),
    )


@functools.cache
def gau_step(config: ModelConfig):
    """jitted (params, codebook, x [B,T,D], state, step [B], lengths [B]) → (out, new state)."""
    fn = hk.without_apply_rng(
        hk.transform_with_state(lambda x, state, step, lengths: GAU(config)(x, state, step, lengths))
    )

    def apply(params, codebook, x, state, step, lengths):
        (out, new_state, _), _ = fn.apply(params, codebook, x, state, step, lengths)
        return out, new_state

    return fn, jax.jit(apply)


def run_splits(config, params, codebook, xs: np.ndarray, splits: list[list[int]], bucket=lambda n: n):
    """Feed row b of xs [B,T,D] in chunks splits[b], all rows through one batched state: call i takes
    chunk i of every row (rows out of chunks idle with length 0), padded to bucket(longest chunk).
    Returns (outputs [B,T,D], final state); asserts idle rows keep every bit of their state."""
    _, step_fn = gau_step(config)
    b, t, d = xs.shape
    state, step = empty_state(config, b), np.zeros(b, np.int32)
    out = np.zeros((b, t, d), np.float32)
    for i in range(max(len(s) for s in splits)):
        lengths = np.asarray([s[i] if i < len(s) else 0 for s in splits], np.int32)
        width = bucket(int(lengths.max()))
        x = np.zeros((b, width, d), np.float32)
        for row in range(b):
            x[row, : lengths[row]] = xs[row, step[row] : step[row] + lengths[row]]
        y, new_state = step_fn(params, codebook, x, state, step, lengths)
        for row in np.nonzero(lengths == 0)[0]:
            for old, new in zip(state, new_state):
                np.testing.assert_array_equal(np.asarray(new[row]), np.asarray(old[row]))
        for row in range(b):
            out[row, step[row] : step[row] + lengths[row]] = np.asarray(y[row, : lengths[row]])
        state, step = new_state, step + lengths
    assert (step == t).all()
    return out, state


def assert_state_equals(state: GAUState, want: dict, atol=ATOL):
    np.testing.assert_array_equal(state.z_win, want["z_win"])
    np.testing.assert_array_equal(state.n, want["n"])  # exact integer counts
    np.testing.assert_allclose(state.v_win, want["v_win"], atol=atol, rtol=RTOL)
    np.testing.assert_allclose(state.u_mean, want["u_mean"], atol=atol, rtol=RTOL)


# ---- the reference implementation's fixture ----------------------------------------------------


@pytest.fixture(scope="module")
def fixture():
    data = dict(np.load(require_fixtures() / "vq" / "vq_reference.npz"))
    config = ModelConfig(
        vocab_size=2,
        dim=int(data["cfg_d_model"]),
        n_layers=1,
        n_heads=int(data["cfg_n_head"]),
        n_kv_heads=int(data["cfg_n_head"]),
        head_dim=int(data["cfg_d_k"]),
        ffn_dim=0,
        norm_eps=float(data["cfg_rmsnorm_eps"]),
        memory="vq",
        vq_value_dim=int(data["cfg_d_v"]),
        vq_codes=int(data["cfg_n_code"]),
        vq_block_len=int(data["cfg_block_len"]),
        vq_mem_len=int(data["cfg_mem_len"]),
        vq_pe_lam=float(data["cfg_pe_lam"]),
    )
    params = {
        "gau/input_norm": {"scale": data["param_input_norm_gain"], "bias": data["param_input_norm_bias"]},
        "gau/q_proj": {"w": data["param_q_proj_kernel"]},
        "gau/kvg_proj": {"w": data["param_kvg_proj_kernel"]},
        "gau/r_proj": {"w": data["param_r_proj_kernel"]},
        "gau/o_proj": {"w": data["param_res_proj_kernel"]},
        "gau": {"xl_u": data["param_xl_u"], "xl_v": data["param_xl_v"]},
    }
    codebook = {"gau/codebook": {"c_sum": data["param_codebook_c_sum"], "c_count": data["param_codebook_c_count"]}}
    return config, params, codebook, data


def fixture_state(data: dict, prefix: str) -> dict:
    return {
        "z_win": data[f"{prefix}window_z"],
        "v_win": data[f"{prefix}window_v"],
        "n": data[f"{prefix}agg_count"],
        "u_mean": data[f"{prefix}agg_mean_v"],
    }


def test_fixture_params_map_onto_the_layer(fixture):
    config, params, codebook, _ = fixture
    fn, _ = gau_step(config)
    shapes = jax.eval_shape(
        fn.init,
        jax.random.PRNGKey(0),
        jnp.zeros((2, 4, config.dim)),
        empty_state(config, 2),
        jnp.zeros(2, jnp.int32),
        jnp.full(2, 4, jnp.int32),
    )
    assert jax.tree_util.tree_map(np.shape, shapes) == jax.tree_util.tree_map(np.shape, (params, codebook))


def test_blockwise_run_a_reproduces_the_reference_implementation(fixture):
    config, params, codebook, data = fixture
    b, t = data["x"].shape[:2]
    splits = [[config.vq_block_len] * (t // config.vq_block_len)] * b
    out, state = run_splits(config, params, codebook, data["x"], splits)
    np.testing.assert_allclose(out, data["res"], atol=ATOL, rtol=RTOL)
    assert_state_equals(state, fixture_state(data, "state_final_"))
    # codes of every key: the final window plus the aggregate counts pin them; check directly too
    ref = reference_gau(params, codebook, data["x"], config)
    np.testing.assert_array_equal(ref["z"], data["z"])
    np.testing.assert_allclose(ref["res"], data["closedform_res"], atol=1e-9)


def test_prefill_then_single_tokens_run_b_reproduces_the_reference_implementation(fixture):
    config, params, codebook, data = fixture
    b, t = data["x"].shape[:2]
    prefill = int(data["cfg_prefill_len"])
    out, state = run_splits(config, params, codebook, data["x"][:, :prefill], [[prefill]] * b)
    assert_state_equals(state, fixture_state(data, "state_after_prefill_"))
    out, state = run_splits(config, params, codebook, data["x"], [[prefill] + [1] * (t - prefill)] * b)
    np.testing.assert_allclose(out, data["res_prefill_then_single"], atol=ATOL, rtol=RTOL)
    assert_state_equals(state, fixture_state(data, "state_final_"))


def test_attention_core_reproduces_wv_and_codes_block_by_block(fixture):
    """The cached attention fed the reference's own intermediates (q, v, codebook, R, u', v')."""
    config, _, _, data = fixture
    q, k, v = (jnp.asarray(data[f"inter_{n}"]) for n in "qkv")
    codes, r = jnp.asarray(data["derived_codebook"]), jnp.asarray(data["derived_rel_pos_R"])
    u, vb = jnp.asarray(data["derived_xl_u_scaled"]), jnp.asarray(data["derived_xl_v_scaled"])
    b, h, t, dv = v.shape
    blk = config.vq_block_len
    lengths = jnp.full(b, blk, jnp.int32)

    @jax.jit
    def block(state, step, q, k, v):
        z = quantize(k, codes)
        return attend(q, u, vb, codes, r, z, None, v, state, step), z, advance(state, z, v, lengths)

    state, step = empty_state(config, b), jnp.zeros(b, jnp.int32)
    wv, zs = [], []
    for i in range(0, t, blk):
        out, z, state = block(state, step, q[:, :, i : i + blk], k[:, :, i : i + blk], v[:, :, i : i + blk])
        wv.append(out)
        zs.append(z)
        step = step + blk
    np.testing.assert_array_equal(jnp.concatenate(zs, -1), data["z"])
    wv = jnp.concatenate(wv, axis=2).transpose(0, 2, 1, 3).reshape(b, t, h * dv)
    np.testing.assert_allclose(wv, data["wv"], atol=ATOL, rtol=RTOL)


# ---- random params: cached form == quadratic reference -----------------------------------------


def random_gau(config: ModelConfig, seed: int):
    """Params and codebook with every ingredient non-trivial (u, v', norm gain and bias, codes)."""
    fn, _ = gau_step(config)
    shapes, _ = jax.eval_shape(
        fn.init,
        jax.random.PRNGKey(0),
        jnp.zeros((1, 1, config.dim)),
        empty_state(config, 1),
        jnp.zeros(1, jnp.int32),
        jnp.ones(1, jnp.int32),
    )
    rng = np.random.default_rng(seed)
    params = {
        module: {
            name: (rng.standard_normal(a.shape) * a.shape[-2] ** -0.5).astype(np.float32) for name, a in names.items()
        }
        for module, names in shapes.items()
        if module.endswith("_proj")
    }
    h, dk, s = config.n_heads, config.head_dim, config.vq_codes
    params["gau"] = {n: 0.7 * rng.standard_normal(h * dk).astype(np.float32) for n in ("xl_u", "xl_v")}
    params["gau/input_norm"] = {
        "scale": (1 + 0.3 * rng.standard_normal(config.dim)).astype(np.float32),
        "bias": (0.5 * rng.standard_normal(config.dim)).astype(np.float32),
    }
    assert jax.tree_util.tree_map(np.shape, params) == jax.tree_util.tree_map(np.shape, shapes)
    count = rng.uniform(0.5, 4.0, (h, s)).astype(np.float32)
    c_sum = (count[..., None] * 0.5 * rng.standard_normal((h, s, dk))).astype(np.float32)
    return params, {"gau/codebook": {"c_sum": c_sum, "c_count": count}}


SMALL = ModelConfig(
    vocab_size=2,
    dim=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=0,
    norm_eps=1e-6,
    memory="vq",
    vq_value_dim=16,
    vq_codes=8,
    vq_block_len=4,
    vq_mem_len=5,
)


def test_any_block_split_equals_the_quadratic_reference_with_rows_at_different_positions():
    config = SMALL
    params, codebook = random_gau(config, 0)
    t = 24
    splits = [
        [24],
        [4] * 6,
        [5, 3, 7, 1, 1, 1, 6],
        [11] + [1] * 13,  # a prefill padded to the bucket of 16, then one token per call
        [1, 2, 3, 18],  # idle (length 0) from the fifth call on
    ]
    xs = np.random.default_rng(1).standard_normal((len(splits), t, config.dim)).astype(np.float32)
    out, state = run_splits(config, params, codebook, xs, splits, bucket=lambda n: 1 if n == 1 else 8 * -(-n // 8))
    ref = reference_gau(params, codebook, xs, config)
    np.testing.assert_allclose(out, ref["res"], atol=ATOL, rtol=RTOL)
    assert_state_equals(state, ref)
    assert len(np.unique(ref["z"])) == config.vq_codes  # every code is in use


def test_after_4096_tokens_counts_means_and_outputs_still_equal_the_reference():
    """Aggregates over thousands of tokens stay exact in float32 (counts) and accurate (means)."""
    config = ModelConfig(
        vocab_size=2,
        dim=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=0,
        norm_eps=1e-6,
        memory="vq",
        vq_value_dim=8,
        vq_codes=8,
        vq_block_len=4,
        vq_mem_len=16,
    )
    params, codebook = random_gau(config, 2)
    t = 4096
    xs = np.random.default_rng(3).standard_normal((1, t, config.dim)).astype(np.float32)
    out, state = run_splits(config, params, codebook, xs, [[512] * 8])
    ref = reference_gau(params, codebook, xs, config)
    np.testing.assert_allclose(out, ref["res"], atol=ATOL, rtol=RTOL)
    assert_state_equals(state, ref)
    assert ref["n"].sum() == 2 * (t - config.vq_mem_len)
    assert ref["n"].min() > 0 and ref["n"].max() > 256  # every code used; counts past bfloat16's exact range
