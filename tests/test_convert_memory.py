"""Peak memory of `hkserve convert` on a ~1.5 GB, 4-shard float32 Llama checkpoint: one copy of the model.

The checkpoint is synthetic (written here, tensor by tensor, so the writer holds one tensor at a time).
Peak RSS is the child's ru_maxrss from os.wait4. The allowance is 1.3x the stored params' bytes
(float32 in, float32 stored: the params' nbytes, which is also what the store holds on disk up to
zstd's small gain on random floats) plus the peak RSS of `hkserve models`, a run that imports the same
CLI, JAX/XLA, orbax and tensorstore and does nothing: the constant every command pays.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import REPO

from hkserve.checkpoint.hf_write import hf_config_dict
from hkserve.model.config import ModelConfig

# 24 layers x 61 MB + two 67 MB embedding matrices: 1.59 GB of float32.
CONFIG = ModelConfig(
    vocab_size=16384, dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, head_dim=64, ffn_dim=4096, tie_embeddings=False
)
SHARDS = 4
SEED_LEN = CONFIG.vocab_size * CONFIG.dim  # the largest tensor's elements


def _hf_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of a Llama checkpoint, in file order."""
    d, q, kv, f = config.dim, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    return shapes | {"model.norm.weight": (d,), "lm_head.weight": (config.vocab_size, d)}


def _source_tensor(seed: np.ndarray, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The `index`-th tensor of the checkpoint: random floats, offset so that no two tensors are equal."""
    return (seed[: int(np.prod(shape))] + np.float32(index)).reshape(shape)


def _write_checkpoint(directory: Path, config: ModelConfig, seed: np.ndarray) -> None:
    """config.json, SHARDS safetensors files (header, then each tensor's bytes) and the index."""
    shapes = _hf_tensors(config)
    names = list(shapes)
    weight_map = {}
    for shard, part in enumerate(np.array_split(np.arange(len(names)), SHARDS)):
        file = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        header, offset = {}, 0
        for k in part:
            size = 4 * int(np.prod(shapes[names[k]]))
            header[names[k]] = {"dtype": "F32", "shape": shapes[names[k]], "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[names[k]] = file
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for k in part:
                f.write(_source_tensor(seed, int(k), shapes[names[k]]).tobytes())
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config)))


def _peak_rss(*args: str, home: Path) -> int:
    """Run the CLI in a child process; → its peak resident set in bytes (Linux ru_maxrss is in KiB)."""
    env = {**os.environ, "HKSERVE_HOME": str(home)}
    child = subprocess.Popen(
        [sys.executable, "-m", "hkserve.cli.main", *args], cwd=REPO, env=env, stderr=subprocess.PIPE
    )
    stderr = child.stderr.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, f"hkserve {' '.join(args)} failed:\n{stderr[-3000:]}"
    return usage.ru_maxrss * 1024


def _restore(path: Path, arrays: dict[str, list[str]]) -> dict:
    """Only the named arrays of a stored params checkpoint, as numpy."""
    item = {module: {name: 0 for name in names} for module, names in arrays.items()}
    restore_args = {
        module: {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names} for module, names in arrays.items()
    }
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(path.absolute(), args=args)


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied at the end: pytest would keep the 2.7 GB of the last three runs."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.timeout(300)
def test_convert_of_a_sharded_checkpoint_holds_the_model_once(scratch):
    source, home = scratch / "source", scratch / "home"
    source.mkdir()
    seed = np.random.default_rng(0).random(SEED_LEN, dtype=np.float32)
    _write_checkpoint(source, CONFIG, seed)
    source_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert source_bytes > 1.4e9

    baseline = _peak_rss("models", home=home)
    peak = _peak_rss("convert", str(source), "--name", "big", "--quiet", home=home)

    params_dir = home / "models" / "big" / "params"
    stored = 4 * sum(int(np.prod(s)) for s in _hf_tensors(CONFIG).values())  # float32 params' bytes
    on_disk = sum(f.stat().st_size for f in params_dir.rglob("*") if f.is_file())
    report = (
        f"peak {peak / 1e6:.0f} MB, stored params {stored / 1e6:.0f} MB ({on_disk / 1e6:.0f} MB on disk), "
        f"`hkserve models` {baseline / 1e6:.0f} MB: peak - baseline = {(peak - baseline) / stored:.2f}x stored"
    )
    print(report)
    assert peak <= 1.3 * stored + baseline, report

    # In-place filling put each layer's tensor, transposed, into its own slice.
    shapes = _hf_tensors(CONFIG)
    index = {name: k for k, name in enumerate(shapes)}
    got = _restore(
        params_dir,
        {
            "decoder/embed": ["embeddings"],
            "decoder/lm_head": ["w"],
            "decoder/layers/attention/k_proj": ["w"],
            "decoder/layers/mlp/down_proj": ["w"],
        },
    )

    def want(name: str) -> np.ndarray:
        return _source_tensor(seed, index[name], shapes[name])

    np.testing.assert_array_equal(got["decoder/embed"]["embeddings"], want("model.embed_tokens.weight"))
    np.testing.assert_array_equal(got["decoder/lm_head"]["w"], want("lm_head.weight").T)
    for i in (0, 11, CONFIG.n_layers - 1):
        np.testing.assert_array_equal(
            got["decoder/layers/attention/k_proj"]["w"][i], want(f"model.layers.{i}.self_attn.k_proj.weight").T
        )
        np.testing.assert_array_equal(
            got["decoder/layers/mlp/down_proj"]["w"][i], want(f"model.layers.{i}.mlp.down_proj.weight").T
        )
