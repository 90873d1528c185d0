"""The families through the real CLI (own HKSERVE_HOME): `hkserve convert`, `hkserve generate --ids
--output-ids` and `hkserve logits --json` against transformers; one dense bf16 model with Llama 3 RoPE, one
Gemma and the sliding-window Mistral (the in-process tests cover every fixture).

The commands run through the CLI's own `main` (its parsing, its error handling and exit status, its
printed output) in this process: a subprocess each cost a Python and JAX start, 17 of them, more than the
tiny models' work. `hkserve` as a process is tests/test_serve.py's, test_sample.py's and others'."""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_fixtures import fixture, reference

from hkserve.cli.main import main

CLI_SUBSET = ["tiny-llama3-rope", "tiny-gemma3", "tiny-mistral-swa"]


def ids_arg(ids) -> str:
    return ",".join(map(str, ids))


@pytest.fixture
def hkserve(tmp_path, monkeypatch, capsys):
    """`hkserve ARGS` with tmp_path as its store → (exit status, stdout, stderr); `check`: status 0."""
    monkeypatch.setenv("HKSERVE_HOME", str(tmp_path))

    def run(*args: str, check: bool = True):
        capsys.readouterr()  # what came before is not this command's
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0 or not check, f"hkserve {' '.join(args)} failed ({code}):\n{err[-3000:]}"
        return code, out, err

    return run


@pytest.mark.parametrize("name", CLI_SUBSET)
def test_convert_generate_ids_and_logits_match_transformers(hkserve, name):
    ref = reference(name)
    hkserve("convert", str(fixture("hf", name)), "--name", name, "--quiet")
    _, out, _ = hkserve(
        "generate", "--model", name, "--ids", ids_arg(ref["greedy_prompt"]), "--output-ids",
        "--temperature", "0", "--max-tokens", str(len(ref["greedy_ids"])),
    )  # fmt: skip
    assert out.strip() == ids_arg(ref["greedy_ids"])
    for row, ids in enumerate(ref["input_ids"]):
        _, out, _ = hkserve("logits", "--model", name, "--ids", ids_arg(ids), "--json")
        logits = np.asarray(json.loads(out)["logits"], np.float32)
        np.testing.assert_allclose(logits, np.asarray(ref["logits"][row]), atol=1e-4, rtol=0, err_msg=f"row {row}")


def test_gguf_model_generates_text_and_ids_and_tokenizer_less_text_is_refused(hkserve):
    hkserve("convert", str(fixture("gguf", "tiny-gemma2", "tiny-gemma2.f32.gguf")), "--name", "g")
    hkserve("generate", "the quick fox", "--model", "g", "--temperature", "0", "--max-tokens", "4")  # as text: status 0
    _, ids, _ = hkserve("generate", "the quick fox", "--model", "g", "--temperature", "0", "--max-tokens", "4",
                        "--output-ids")  # fmt: skip
    assert len(ids.strip().split(",")) == 4
    _, out, _ = hkserve("logits", "the quick fox", "--model", "g")  # text table: pos, id, argmax, logit
    assert out.splitlines()[0].split("\t")[0] == "0"
    hkserve("convert", str(fixture("hf", "tiny-qwen2")), "--name", "q", "--quiet")
    code, _, err = hkserve("generate", "--model", "q", "--ids", "5,17,3", check=False)
    assert code == 1 and "--output-ids" in err


def test_convert_refuses_an_unimplemented_config_field(tmp_path, hkserve):
    source = tmp_path / "yarn"
    source.mkdir()
    cfg = json.loads(fixture("hf", "tiny-llama-tied", "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (source / "config.json").write_text(json.dumps(cfg))
    (source / "model.safetensors").symlink_to(fixture("hf", "tiny-llama-tied", "model.safetensors"))
    code, _, err = hkserve("convert", str(source), "--name", "y", check=False)
    assert code == 1
    assert "rope_type 'yarn'" in err and "hkserve convert: error:" in err
