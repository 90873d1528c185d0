"""A damaged model store: one broken model never hides the others, and is named in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import init_params

from hkserve.checkpoint.store import DamagedModel, ModelStore
from hkserve.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HKSERVE_HOME": str(home), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hkserve", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def store(tmp_path) -> ModelStore:
    store = ModelStore(tmp_path)
    params = init_params(CONFIG, 0)
    for name in ("good", "broken-config", "truncated"):
        store.save(name, CONFIG, params, None, {"format": "test"})
    (store.path("broken-config") / "config.json").write_text('{"vocab_size": 64, "dim": ')
    data = [p for p in (store.path("truncated") / "params").rglob("*") if p.is_file() and p.stat().st_size > 64]
    for p in data:  # every data file cut to a few bytes: what a full disk or a killed copy leaves
        p.write_bytes(p.read_bytes()[:16])
    return store


def test_list_keeps_the_readable_models_and_names_the_damaged(store):
    models, damaged = store.scan()
    assert [m.name for m in models] == ["good", "truncated"]  # its config is fine; its params are not
    assert [d.name for d in damaged] == ["broken-config"]
    assert str(damaged[0]).startswith("model broken-config is damaged: ")
    with pytest.raises(DamagedModel, match=r"^model truncated is damaged: cannot read .*params"):
        store.params("truncated")
    with pytest.raises(DamagedModel, match="is missing"):
        ModelStore._restore(store.info("good"), store.path("good") / "nowhere", CONFIG, None)
    assert set(store.params("good")) == set(init_params(CONFIG, 0))


def test_cli_lists_what_it_can_and_fails_in_one_line(store):
    listed = _cli(store.root, "models")
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["good", "truncated"]
    assert "model broken-config is damaged:" in listed.stderr

    for name in ("truncated", "broken-config"):
        result = _cli(store.root, "generate", "x", "--model", name, "--max-tokens", "1")
        assert result.returncode == 1
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert errors and errors[-1].startswith(f"hkserve generate: error: model {name} is damaged: "), result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 5, result.stderr
