"""int8/int4 weights stored in the CPU kernels' packed layout (issue 37: a start loads them, it does not
repack them), marked by `<params dir>.packed.json` holding the layout's version (model/packing.py).

The packed layout is the one the serving model's `prepare` makes (model/packing.py pack_layers: each
weight the kernels read packed on its own, the param tree's structure kept), so the bytes on disk are
the same bytes, in another order, and a start that serves with the kernels only fuses them. The XLA
path (GPUs, `--kernels xla`, other commands) gets them unpacked on load (unpack_layers)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np

from hkserve.checkpoint.expand import QUANTIZED
from hkserve.kernels.dispatch import KernelSpec
from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig
from hkserve.model.packing import STORED_LAYOUT, stored_packing


def marker(path: Path) -> Path:
    return path.with_name(path.name + ".packed.json")


def stored_layout(path: Path) -> int | None:
    """The packed layout version of the params at `path`, None where they are stored plain."""
    return json.loads(marker(path).read_text())["layout"] if marker(path).is_file() else None


@functools.cache
def kernel_packing(config: ModelConfig):
    """pack_layers of `config`'s kernel-mode model (the layout does not depend on the CPU's ISA or the
    kernel kind; "scan": the stacked layers the kernels read, on any backend: a GPU's default loop would
    refuse them), or None where the kernels would pack nothing (float, Transformer-VQ)."""
    if config.dtype not in QUANTIZED or config.memory != "kv":
        return None
    return stored_packing(build_model(config, KernelSpec("w8a16", 1), "scan").prepare)


def pack_for_store(params: dict, config: ModelConfig, path: Path) -> dict:
    """The params to write at `path`: packed (and `path`'s marker written) where the kernels read them
    packed, else as they are. The marker goes first: a crash before the params' rename leaves no params."""
    packing = kernel_packing(config)
    if packing is None:
        return params
    marker(path).write_text(json.dumps({"layout": STORED_LAYOUT}))
    return jax.tree_util.tree_map(np.asarray, jax.jit(packing)(params))
