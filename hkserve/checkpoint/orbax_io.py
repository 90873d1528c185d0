"""Orbax save/restore of a param tree; restore goes straight onto target shardings."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig


def save_params(path: Path, params: dict) -> None:
    """Blocking save. Orbax needs an absolute path and a directory that does not exist yet."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(path).absolute(), params)
    checkpointer.wait_until_finished()


def restore_params(path: Path, config: ModelConfig, shardings=None) -> dict:
    """Restore params of `config`; `shardings` is a tree of jax.sharding.Sharding like the params
    (default: everything on the first device). Each array is read directly into its sharding."""
    shapes = param_shapes(config)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: device, shapes)
    target = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
    return ocp.StandardCheckpointer().restore(Path(path).absolute(), target)
