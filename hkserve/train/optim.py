"""The optax update: global-norm clipping, then AdamW / Lion / Adafactor on a learning-rate schedule,
with decoupled weight decay on weight matrices and embeddings only.

The optimizer sees the trainable params and nothing else: the VQ codebook lives in a separate tree
moved by its EMA, so no optimizer state, clipping norm or decay ever includes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# Leaves that are gains, offsets or biases (or learned per-channel vectors): decay would pull them
# to 0, which for a norm gain means switching the layer off rather than regularising it.
_NO_DECAY_NAMES = ("scale", "offset", "bias", "b", "gain")


def decay_mask(params) -> dict:
    """True for the leaves weight decay applies to. A leaf is spared when its module is a norm, its
    name is a gain/bias, or it is a vector once the layer-stack axis is discounted."""

    def decays(path, leaf) -> bool:
        keys = [str(k.key if isinstance(k, jax.tree_util.DictKey) else k) for k in path]
        module, name = "/".join(keys[:-1]), keys[-1]
        stacked = "layers" in module.split("/")  # hk.layer_stack adds a leading [n_layers] axis
        matrix_dims = leaf.ndim - (1 if stacked else 0)
        return "norm" not in module and name not in _NO_DECAY_NAMES and matrix_dims >= 2

    return jax.tree_util.tree_map_with_path(decays, params)


def make_schedule(opt, steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine or linear decay to end_lr_ratio·lr at `steps`, or
    inverse-square-root decay (lr·sqrt(warmup / step) after warmup)."""
    lr, warmup = opt.lr, opt.warmup_steps
    end = lr * opt.end_lr_ratio
    if opt.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=end)
    if opt.schedule == "linear":
        decay = optax.linear_schedule(lr, end, steps - warmup)
    else:
        offset = max(warmup, 1)
        # join_schedules also evaluates this branch before the boundary (count < 0): keep it finite
        decay = lambda count: lr * jnp.sqrt(offset / jnp.maximum(count + offset, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def make_optimizer(opt, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(opt, steps)
    if opt.name == "adamw":
        inner = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)
    elif opt.name == "lion":
        inner = optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)
    else:
        inner = optax.adafactor(schedule, weight_decay_rate=opt.weight_decay or None, weight_decay_mask=decay_mask)
    chain = [optax.clip_by_global_norm(opt.grad_clip)] if opt.grad_clip > 0 else []
    return optax.chain(*chain, inner), schedule
