"""One training interface over both memory kinds, so the loop never branches on the model.

VQ (Transformer-VQ): params are trained; the codebook is Haiku state moved only by its EMA; the
attention state (VQMemory) is carried from one update to the next within a sequence.
KV (softmax baseline): no codebook, no carry: every update attends within its own chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig
from hkserve.model.memory import init_memory as init_kv_memory
from hkserve.model.vq_memory import init_memory as init_vq_memory
from hkserve.model.vq_model import ema_update, init_train, serving_params, train_forward


class Aux(NamedTuple):
    commit: jax.Array  # [] commitment loss (0 for KV)
    stats: Any  # codebook-shaped sums for the EMA ({} for KV)


class TrainModel(NamedTuple):
    config: ModelConfig
    init: Callable  # (rng) -> (params, codebook)
    forward: Callable  # (params, codebook, tokens [B,T], carry, is_train) -> (logits [B,T,V] f32, Aux, carry)
    init_carry: Callable  # (batch) -> carry at the start of a sequence
    ema_update: Callable  # (codebook, stats, gamma) -> codebook
    serving_params: Callable  # (params, codebook) -> params for ModelStore.save


def committed(tree):
    """`tree` placed on the default device explicitly. Restored and step-output arrays are committed
    to a device, fresh ones are not, and jit compiles once per placement: a fresh carry at every
    sequence start (or a fresh state) must be committed too, or the step compiles a second time."""
    return jax.device_put(tree, jax.devices()[0])


def _kv_model(config: ModelConfig) -> TrainModel:
    model = build_model(config)

    def forward(params, codebook, tokens, carry, is_train=True):
        b, t = tokens.shape
        lengths = jnp.full((b,), t, jnp.int32)
        logits, _ = model.forward(params, tokens, init_kv_memory(config, b, t), lengths)
        return logits.astype(jnp.float32), Aux(jnp.zeros((), jnp.float32), {}), ()

    return TrainModel(
        config=config,
        init=lambda rng: (model.init(rng), {}),
        forward=forward,
        init_carry=lambda batch: (),
        ema_update=lambda codebook, stats, gamma: codebook,
        serving_params=lambda params, codebook: params,
    )


def _vq_model(config: ModelConfig) -> TrainModel:
    def forward(params, codebook, tokens, carry, is_train=True):
        logits, aux, carry = train_forward(config, params, codebook, tokens, carry, is_train=is_train)
        aux = Aux(aux.commit, aux.stats) if is_train else Aux(jnp.zeros((), jnp.float32), {})  # eval: no aux
        return logits.astype(jnp.float32), aux, carry

    return TrainModel(
        config=config,
        init=lambda rng: init_train(config, rng),
        forward=forward,
        init_carry=lambda batch: committed(init_vq_memory(config, batch)),
        ema_update=ema_update,
        serving_params=serving_params,
    )


def build_train_model(config: ModelConfig) -> TrainModel:
    if config.memory == "kv":
        return _kv_model(config)
    if config.memory == "vq":
        return _vq_model(config)
    raise ValueError(f"cannot train memory kind {config.memory!r} (vq | kv)")
