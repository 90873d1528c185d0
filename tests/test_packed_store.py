"""int8/int4 weights stored in the CPU kernels' packed layout (issue 37: a start loads them, it does not
repack them): a packed store loads to exactly the params that packing at start makes, unpacks to the
plain ones for the XLA path, refuses another layout version in one line, and a store written before
(plain) still loads; the layout's bytes are pinned, so a change to kernels/pack.py or pack4.py must bump
model/packing.py's STORED_LAYOUT."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import REPO, init_params, tiny_config

from hkserve.checkpoint.orbax_io import save_params
from hkserve.checkpoint.packed_store import kernel_packing, marker
from hkserve.checkpoint.quantize import convert_params
from hkserve.checkpoint.store import DamagedModel, ModelStore
from hkserve.kernels.dispatch import KernelSpec
from hkserve.model.build import build_model, param_shapes
from hkserve.model.packing import STORED_LAYOUT, stored_packing

CASES = [("int8", True), ("int8", False), ("int4", True), ("int4", False)]


def _variant(dtype: str, tied: bool):
    """(config, plain numpy params) of a small random model: K and N not multiples of the tiles."""
    base = tiny_config(dim=96, ffn_dim=160, vocab_size=200, tie_embeddings=tied)
    master = jax.tree_util.tree_map(np.asarray, init_params(base, 3))
    return convert_params(master, base, dtype)


def _random(rng, shape, dtype) -> np.ndarray:
    """Machine-independent values of any stored dtype (numpy's generator, no float kernels)."""
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _equal(a: dict, b: dict) -> bool:
    same = jax.tree_util.tree_map(lambda x, y: x.dtype == y.dtype and np.array_equal(x, y), a, b)
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and jax.tree_util.tree_all(same)


@pytest.mark.parametrize(("dtype", "tied"), CASES, ids=lambda v: str(v))
def test_a_packed_store_loads_what_packing_at_start_makes(tmp_path, dtype, tied):
    config, plain = _variant(dtype, tied)
    store = ModelStore(tmp_path)
    path = store.save("m", config, plain, None, {})
    assert json.loads(marker(path / "params").read_text()) == {"layout": STORED_LAYOUT}
    model = build_model(config, KernelSpec("w8a16", 1))
    packed = store.params("m", packing=stored_packing(model.prepare))
    assert any(v.dtype == np.uint8 for v in jax.tree_util.tree_leaves(packed))
    prepare = jax.jit(model.prepare)
    assert _equal(prepare(packed), prepare(plain))  # the engine's prepare: only fuses what the store packed
    assert _equal(store.params("m"), plain)  # the XLA path: unpacked


def test_a_plain_store_of_before_still_loads_and_another_layout_is_refused(tmp_path):
    config, plain = _variant("int4", True)
    store = ModelStore(tmp_path)
    path = store.save("m", config, plain, None, {"path": "x.gguf"})
    save_params(path / "plain", plain)  # as stores were written before: no marker, the plain layout
    marker(path / "params").unlink()
    (path / "params").rename(path / "packed")
    (path / "plain").rename(path / "params")
    model = build_model(config, KernelSpec("w8a16", 1))
    assert _equal(store.params("m", packing=stored_packing(model.prepare)), plain)
    marker(path / "params").write_text(json.dumps({"layout": STORED_LAYOUT + 1}))
    with pytest.raises(DamagedModel, match=r"packed in layout 2, this hkserve reads 1: convert the model again"):
        store.params("m")


def test_the_stored_packed_layout_is_pinned():
    """sha256 of the packed bytes of one int8 and one int4 model: a different pack step (or a changed
    layout in kernels/pack.py, pack4.py) fails here; bump STORED_LAYOUT and this digest together."""
    digest, rng = hashlib.sha256(), np.random.default_rng(0)
    for dtype in ("int8", "int4"):
        config = tiny_config(dim=96, ffn_dim=160, vocab_size=200, tie_embeddings=True, dtype=dtype)
        plain = jax.tree_util.tree_map(lambda s: _random(rng, s.shape, s.dtype), param_shapes(config))
        for leaf in jax.tree_util.tree_leaves(kernel_packing(config)(plain)):
            digest.update(np.asarray(leaf).tobytes())
    assert (STORED_LAYOUT, digest.hexdigest()[:16]) == (1, "78b214418784fcb3")


MESH_SCRIPT = """
import sys, jax, numpy as np
sys.path.insert(0, "tests")
from test_packed_store import _equal, _variant
from hkserve.checkpoint.store import ModelStore
from hkserve.model.build import param_shapes
from hkserve.model.sharding import param_shardings, parse_mesh
config, plain = _variant("int8", False)
store = ModelStore(sys.argv[1])
store.save("m", config, plain, None, {})
mesh = parse_mesh("2x4", config)
shardings = param_shardings(param_shapes(config), mesh, config)
got = store.params("m", shardings)
assert _equal(jax.device_get(got), plain)
assert all(a.sharding == s for a, s in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(shardings)))
print("ok")
"""


def test_a_packed_store_restores_plain_onto_a_mesh(tmp_path):
    """The XLA path on 8 devices (2x4): the packed params, unpacked, land on the mesh's plain shardings."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", MESH_SCRIPT, str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_stored_5_bit_layout_is_pinned():
    """The same for an int4 model whose q/k/v and gate/up are signed 5-bit groups (kernels/pack4.pack5, its
    high-bit plane): a changed plane fails here (stores of the int5 form hold it packed)."""
    digest, rng = hashlib.sha256(), np.random.default_rng(0)
    config = tiny_config(dim=96, ffn_dim=160, vocab_size=200, tie_embeddings=True, dtype="int4")
    config = config.replace(int5_linears=("gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"))
    plain = jax.tree_util.tree_map(lambda s: _random(rng, s.shape, s.dtype), param_shapes(config))
    for leaf in jax.tree_util.tree_leaves(kernel_packing(config)(plain)):
        digest.update(np.asarray(leaf).tobytes())
    assert (STORED_LAYOUT, digest.hexdigest()[:16]) == (1, "8a75636bc1c1e088")
