"""Orbax save/restore of a param tree; restore goes straight onto target shardings."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig

# Saving holds the model once. Orbax's default numpy handler deep-copies every array before its
# (asynchronous) write: a second copy; the save here is synchronous and nothing changes the arrays
# while it writes (jax arrays keep orbax's own handler). And with OCDBT data files of up to 2 GiB, an
# array is one chunk and the zstd-compressed chunks wait in memory for their file (measured: +0.55x a
# 1.6 GB model); files, and so chunks, of at most 32 MiB bound that (+15 MB).
_NO_COPY = ocp.type_handlers.create_type_handler_registry(
    (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
    (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
)
_DATA_FILE_BYTES = 32 << 20


def save_params(path: Path, params: dict) -> None:
    """Blocking save; numpy arrays are written from themselves, uncopied. Orbax needs an absolute path
    and a directory that does not exist yet."""
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=_NO_COPY))
    checkpointer.save(
        Path(path).absolute(), args=ocp.args.PyTreeSave(params, ocdbt_target_data_file_size=_DATA_FILE_BYTES)
    )


def restore_params(path: Path, config: ModelConfig, shardings=None, shapes=None) -> dict:
    """Restore params of `config` (of `shapes` where they are stored in another layout: packed);
    `shardings` is a tree of jax.sharding.Sharding like the params (default: everything on the first
    device). Each array is read directly into its sharding."""
    shapes = param_shapes(config) if shapes is None else shapes
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: device, shapes)
    target = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
    return ocp.StandardCheckpointer().restore(Path(path).absolute(), target)
