"""Export a trained state into the model store, where `hkserve generate|serve --model NAME` finds it:
the model config (with its memory kind), serving params and the run's tokenizer."""

from __future__ import annotations

from pathlib import Path

import jax

from hkserve.checkpoint.store import ModelStore
from hkserve.train.step import TrainState


def export_model(session, state: TrainState, name: str, store: ModelStore | None = None) -> Path:
    params = jax.device_get(session.model.serving_params(state.params, state.codebook))
    source = {
        "format": "hkserve-train",
        "config": session.source,
        "step": int(state.step),
        "memory": session.model.config.memory,
    }
    store = store or ModelStore()
    return store.save(name, session.model.config, params, session.tokenizer, source, overwrite=True)
