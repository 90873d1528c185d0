"""The training state and the jitted update that advances it by one optimizer step.

loss = masked mean NLL + β·commit           (gradient w.r.t. params only)
params ← optax(clip → optimizer → schedule)
codebook ← EMA(codebook, stats of this step's keys, γ)   (once per optimizer step)
carry ← stop_gradient(new carry)           (attention state into the next chunk)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hkserve.train.adapter import TrainModel, committed
from hkserve.train.data import Batch


class TrainState(NamedTuple):
    step: jax.Array  # [] int32: optimizer updates done so far
    params: Any  # hk.Params: what the optimizer trains
    codebook: Any  # hk.State: VQ codebook sums/counts, moved only by the EMA ({} for KV)
    opt_state: Any  # optax state over `params` alone
    carry: Any  # attention state carried into the next chunk of the sequence (() for KV)


class StepMetrics(NamedTuple):
    loss: jax.Array  # [] nll + β·commit
    nll: jax.Array  # [] nats per scored token
    commit: jax.Array  # [] commitment loss
    grad_norm: jax.Array  # [] global norm before clipping
    lr: jax.Array  # [] learning rate applied this step


def init_state(model: TrainModel, tx: optax.GradientTransformation, seed: int, batch: int) -> TrainState:
    """A fresh state. Built under one jit: run eagerly, every op of the init compiles on its own."""

    def build():
        params, codebook = model.init(jax.random.PRNGKey(seed))
        return TrainState(jnp.zeros((), jnp.int32), params, codebook, tx.init(params), model.init_carry(batch))

    return committed(jax.jit(build)())


def masked_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed NLL in nats, number of scored tokens) for logits [B,T,V], targets/mask [B,T]."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]  # [B, T]
    return -(picked * mask).sum(), mask.sum()


def make_train_step(
    model: TrainModel,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    commit_beta: float,
    codebook_gamma: float,
):
    """→ jitted (state, batch) -> (state, StepMetrics)."""

    def loss_fn(params, codebook, batch: Batch, carry):
        logits, aux, new_carry = model.forward(params, codebook, batch.inputs, carry, True)
        total, count = masked_nll(logits, batch.targets, batch.mask)
        nll = total / jnp.maximum(count, 1.0)
        return nll + commit_beta * aux.commit, (nll, aux, new_carry)

    @jax.jit
    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (nll, aux, carry)), grads = grad_fn(state.params, state.codebook, batch, state.carry)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        codebook = model.ema_update(state.codebook, aux.stats, codebook_gamma)
        new_state = TrainState(state.step + 1, params, codebook, opt_state, jax.lax.stop_gradient(carry))
        return new_state, StepMetrics(loss, nll, aux.commit, optax.tree.norm(grads), schedule(state.step))

    return train_step


def make_eval_step(model: TrainModel):
    """→ jitted (params, codebook, batch, carry) -> (summed NLL, scored tokens, carry)."""

    @jax.jit
    def eval_step(params, codebook, batch: Batch, carry):
        logits, _, carry = model.forward(params, codebook, batch.inputs, carry, False)
        total, count = masked_nll(logits, batch.targets, batch.mask)
        return total, count, carry

    return eval_step
