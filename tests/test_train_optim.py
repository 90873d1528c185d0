"""Schedules and optimizers: the learning-rate shapes, and weight decay only where it belongs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hkserve.train.config import OptimizerConfig
from hkserve.train.optim import decay_mask, make_optimizer, make_schedule

PARAMS = {  # the shapes and names of a Haiku tree: stacked layers, norms, biases
    "decoder/embed": {"embeddings": jnp.ones((10, 4))},
    "decoder/layers/gau": {"xl_u": jnp.ones((2, 4))},
    "decoder/layers/gau/input_norm": {"scale": jnp.ones((2, 4)), "bias": jnp.ones((2, 4))},
    "decoder/layers/gau/q_proj": {"w": jnp.ones((2, 4, 4))},
    "decoder/final_norm": {"scale": jnp.ones((4,))},
    "decoder/out_bias": {"b": jnp.ones((10,))},
}


def test_decay_applies_to_matrices_only():
    mask = decay_mask(PARAMS)
    decayed = sorted(f"{m}:{n}" for m, leaves in mask.items() for n, on in leaves.items() if on)
    assert decayed == ["decoder/embed:embeddings", "decoder/layers/gau/q_proj:w"]


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_weight_decay_skips_norms_and_biases(name):
    opt = OptimizerConfig(name=name, lr=0.1, schedule="linear", end_lr_ratio=1.0, weight_decay=0.5, grad_clip=1.0)
    tx, _ = make_optimizer(opt, steps=10)
    zero = {m: {n: jnp.zeros_like(v) for n, v in leaves.items()} for m, leaves in PARAMS.items()}
    updates, _ = tx.update(zero, tx.init(PARAMS), PARAMS)
    new = optax.apply_updates(PARAMS, updates)
    mask = decay_mask(PARAMS)
    for m, leaves in new.items():
        for n, value in leaves.items():
            # zero gradient: only decay moves a weight, by lr * wd (linear schedule starts at lr)
            np.testing.assert_allclose(value, 1.0 - 0.05 if mask[m][n] else 1.0, rtol=1e-6, err_msg=f"{m}:{n}")


def test_adafactor_steps():
    opt = OptimizerConfig(name="adafactor", lr=0.01, weight_decay=0.1)
    tx, _ = make_optimizer(opt, steps=10)
    grads = {m: {n: jnp.full_like(v, 0.3) for n, v in leaves.items()} for m, leaves in PARAMS.items()}
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    assert all(bool(jnp.all(jnp.isfinite(u) & (u < 0))) for u in jax.tree_util.tree_leaves(updates))


@pytest.mark.parametrize(
    "schedule, points",
    [
        ("cosine", {0: 0.0, 5: 0.5, 10: 1.0, 55: 0.55, 100: 0.1}),
        ("linear", {0: 0.0, 10: 1.0, 55: 0.55, 100: 0.1}),
        ("inverse_sqrt", {0: 0.0, 10: 1.0, 40: 0.5, 160: 0.25}),  # lr * sqrt(warmup / step),
    ],
)
def test_schedules_warm_up_then_decay(schedule, points):
    fn = make_schedule(OptimizerConfig(lr=1.0, schedule=schedule, warmup_steps=10, end_lr_ratio=0.1), steps=100)
    for step, lr in points.items():
        assert float(fn(step)) == pytest.approx(lr, abs=1e-6), (schedule, step)
