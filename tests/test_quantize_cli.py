"""`hkserve quantize NAME --weights int4` (cli/quantize.py, issue 36): an HF safetensors checkpoint imported
as float32 gets its int4 variant made from the float master (each weight within the min/max bound of its
group of 32), stored beside it and recorded as the CPU default; --text reports the perplexity of both; a
model stored without a float master is refused and left unchanged."""

from __future__ import annotations

import re
import shutil

import gguf
import jax
import numpy as np
import pytest
from helpers import require_fixtures
from test_gguf import sp, write_llama_gguf  # noqa: F401 (sp: the tokenizer fixture)
from test_weights import TEXT

from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.store import ModelStore
from hkserve.cli.eval_ppl import perplexity
from hkserve.cli.loading import serving_weights
from hkserve.cli.main import main
from hkserve.model.int4 import Int4Weight, dequantize


@pytest.fixture()
def home(tmp_path, monkeypatch) -> ModelStore:
    monkeypatch.setenv("HKSERVE_HOME", str(tmp_path / "home"))
    return ModelStore(tmp_path / "home")


def test_quantize_makes_int4_from_the_float_master_and_serves_it_on_a_cpu(home, tmp_path, sp, capsys):  # noqa: F811
    hf = tmp_path / "tiny-llama-untied"  # the fixture's safetensors with a tokenizer: --text needs one
    shutil.copytree(require_fixtures() / "hf" / "tiny-llama-untied", hf)
    (hf / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    convert(hf, "tiny", home, progress=False)
    assert home.info("tiny").config.dtype == "float32" and "weights" not in home.info("tiny").source
    text = tmp_path / "genesis.txt"
    text.write_text(TEXT)
    assert main(["quantize", "tiny", "--weights", "int4", "--text", str(text), "--kernels", "xla"]) == 0
    out = capsys.readouterr().out

    master, variant = home.params("tiny"), home.params("tiny", weights="int4")
    for module, names in variant.items():
        if "w" not in names or "scale" not in names:
            continue
        w = np.asarray(master[module]["w"], np.float32)  # [..., K, N]
        got = dequantize(Int4Weight(*(np.asarray(names[k]) for k in ("w", "scale", "min"))))[..., : w.shape[-2], :]
        k_pad = -(-w.shape[-2] // 32) * 32
        groups = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, k_pad - w.shape[-2]), (0, 0)])
        groups = groups.reshape(*w.shape[:-2], k_pad // 32, 32, w.shape[-1])
        bound = np.repeat((groups.max(-2) - groups.min(-2)) / 30, 32, axis=-2)[..., : w.shape[-2], :]
        assert np.all(np.abs(got - w) <= bound * (1 + 1e-5) + 1e-6), module
        assert np.abs(got - w).max() > 0, module  # 4 bits: lossy on random floats
    assert home.info("tiny").source["weights"] == "int4"
    assert jax.default_backend() != "cpu" or serving_weights(home, "tiny", None) == "int4"
    assert f"int4 {home.variant_sizes('tiny')['int4'] / 1e6:.1f} MB" in out

    ids = home.tokenizer("tiny").encode(TEXT)
    float_ppl, _ = perplexity(home.config("tiny"), master, ids, 512)
    match = re.search(r"float32 ([\d.]+), int4 ([\d.]+) \(([+-][\d.]+)%\)", out)
    assert match, out
    reported_float, reported_int4, cost = (float(g) for g in match.groups())
    assert reported_float == pytest.approx(float_ppl, abs=1e-4)
    assert reported_int4 != reported_float and abs(cost) < 5  # a random tiny model: small but not zero


def test_quantize_refuses_a_model_without_a_float_master(home, tmp_path, sp, capsys):  # noqa: F811
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(
        path, require_fixtures() / "hf" / "tiny-llama-untied", sp, quantize=True, qtype=gguf.GGMLQuantizationType.Q4_0
    )
    convert(path, "tiny", home, progress=False)  # the file's int4 blocks alone
    before = home.info("tiny").source
    assert main(["quantize", "tiny", "--weights", "int8"]) == 1
    assert "not a float master" in capsys.readouterr().err
    assert home.info("tiny").source == before
    assert [p.name for p in home.path("tiny").glob("params*") if p.is_dir()] == ["params"]
