"""`hkserve bench serve`'s in-process side builds its engine as `hkserve serve` does with default flags
(bench/serve_runner.py `runner_engine`): the weights serve picks (a store's int4 on a CPU) and the CPU
kernels `--kernels auto` resolves. It once built a bare model, so the runner side measured XLA's
attention gather (and float32 for an int4 store) beside a server running the kernels."""

from __future__ import annotations

import shutil

import pytest
from helpers import require_fixtures
from test_gguf import sp  # noqa: F401 (the tokenizer fixture)

from hkserve.bench.serve_runner import KVOptions, runner_engine
from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.store import ModelStore, serving_weights
from hkserve.cli.main import main
from hkserve.kernels.dispatch import machine_isa, resolve


@pytest.fixture()
def home(tmp_path, monkeypatch, sp) -> ModelStore:  # noqa: F811
    monkeypatch.setenv("HKSERVE_HOME", str(tmp_path / "home"))
    hf = tmp_path / "tiny-llama-untied"
    shutil.copytree(require_fixtures() / "hf" / "tiny-llama-untied", hf)
    (hf / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    store = ModelStore(tmp_path / "home")
    convert(hf, "tiny", store, progress=False)
    return store


KV = KVOptions("paged", 4.0, 32, "auto")


def test_the_runner_side_runs_the_kernels_serve_resolves_for_a_float_model(home):
    engine = runner_engine("tiny", 2, 0, 128, KV)
    assert engine.model.config.dtype == "float32"
    assert engine.model.kernels == resolve("auto", "float32", "kv")
    assert machine_isa() == 0 or engine.model.kernels is not None  # the decode-attention kernel


def test_the_runner_side_serves_an_int4_store_as_int4_through_the_kernels(home):
    assert main(["quantize", "tiny", "--weights", "int4"]) == 0
    assert serving_weights(home, "tiny", None) == "int4"
    engine = runner_engine("tiny", 2, 0, 128, KV)
    assert engine.model.config.dtype == "int4"
    assert engine.model.kernels == resolve("auto", "int4", "kv")
    assert machine_isa() == 0 or engine.model.kernels.int4 == "w4a8"
