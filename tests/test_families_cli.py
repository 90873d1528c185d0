"""The families through the real CLI (own HKSERVE_HOME): `hkserve convert`, `hkserve generate --ids
--output-ids` and `hkserve logits --json` against transformers; one dense bf16 model with Llama 3 RoPE, one
Gemma and the sliding-window Mistral (the in-process tests cover every fixture)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_fixtures import fixture, reference
from helpers import hkserve

CLI_SUBSET = ["tiny-llama3-rope", "tiny-gemma3", "tiny-mistral-swa"]


def ids_arg(ids) -> str:
    return ",".join(map(str, ids))


@pytest.mark.parametrize("name", CLI_SUBSET)
def test_convert_generate_ids_and_logits_match_transformers(tmp_path, name):
    ref = reference(name)
    hkserve("convert", str(fixture("hf", name)), "--name", name, "--quiet", home=tmp_path)
    out = hkserve(
        "generate", "--model", name, "--ids", ids_arg(ref["greedy_prompt"]), "--output-ids",
        "--temperature", "0", "--max-tokens", str(len(ref["greedy_ids"])), home=tmp_path,
    )  # fmt: skip
    assert out.stdout.strip() == ids_arg(ref["greedy_ids"])
    for row, ids in enumerate(ref["input_ids"]):
        out = hkserve("logits", "--model", name, "--ids", ids_arg(ids), "--json", home=tmp_path)
        logits = np.asarray(json.loads(out.stdout)["logits"], np.float32)
        np.testing.assert_allclose(logits, np.asarray(ref["logits"][row]), atol=1e-4, rtol=0, err_msg=f"row {row}")


def test_gguf_model_generates_text_and_ids_and_tokenizer_less_text_is_refused(tmp_path):
    hkserve("convert", str(fixture("gguf", "tiny-gemma2", "tiny-gemma2.f32.gguf")), "--name", "g", home=tmp_path)
    text = hkserve(
        "generate", "the quick fox", "--model", "g", "--temperature", "0", "--max-tokens", "4", home=tmp_path
    )
    ids = hkserve("generate", "the quick fox", "--model", "g", "--temperature", "0", "--max-tokens", "4",
                  "--output-ids", home=tmp_path)  # fmt: skip
    assert text.returncode == 0 and len(ids.stdout.strip().split(",")) == 4
    out = hkserve("logits", "the quick fox", "--model", "g", home=tmp_path)  # text table: pos, id, argmax, logit
    assert out.stdout.splitlines()[0].split("\t")[0] == "0"
    hkserve("convert", str(fixture("hf", "tiny-qwen2")), "--name", "q", "--quiet", home=tmp_path)
    refused = hkserve("generate", "--model", "q", "--ids", "5,17,3", home=tmp_path, check=False)
    assert refused.returncode == 1 and "--output-ids" in refused.stderr


def test_convert_refuses_an_unimplemented_config_field(tmp_path):
    source = tmp_path / "yarn"
    source.mkdir()
    cfg = json.loads(fixture("hf", "tiny-llama-tied", "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (source / "config.json").write_text(json.dumps(cfg))
    (source / "model.safetensors").symlink_to(fixture("hf", "tiny-llama-tied", "model.safetensors"))
    result = hkserve("convert", str(source), "--name", "y", home=tmp_path / "home", check=False)
    assert result.returncode == 1
    assert "rope_type 'yarn'" in result.stderr and "hkserve convert: error:" in result.stderr
