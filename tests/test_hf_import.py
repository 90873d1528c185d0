"""HF safetensors import against the logits transformers computed for the same checkpoints."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import require_fixtures

from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.params import ImportFormatError
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory

CHECKPOINTS = ["tiny-llama-tied", "tiny-llama-untied", "tiny-mixtral"]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_imported_logits_and_greedy_continuation_match_transformers(name):
    directory = require_fixtures() / "hf" / name
    reference = json.loads((directory / "reference.json").read_text())
    config, params = load_hf(directory)
    model = build_model(config)
    ids = np.asarray(reference["input_ids"], np.int32)  # [2, 13]
    memory = init_memory(config, ids.shape[0], ids.shape[1])
    logits, _ = jax.jit(model.forward)(params, ids, memory, np.full(ids.shape[0], ids.shape[1], np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference["logits"]), atol=1e-4, rtol=0)

    runner = InferenceRunner(Engine(model, params, EngineOptions(slots=1, max_len=64))).start(warmup=False)
    try:
        greedy = [t.id for t in runner.generate(Request(reference["greedy_prompt"], len(reference["greedy_ids"])))]
    finally:
        runner.stop()
    assert greedy == reference["greedy_ids"]


def test_config_reads_rope_theta_from_either_place():
    base = json.loads((require_fixtures() / "hf" / "tiny-llama-untied" / "config.json").read_text())
    nested = config_from_hf(base)
    flat = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 500000.0}
    assert nested.rope_theta == config_from_hf(flat).rope_theta == 500000.0
    assert config_from_hf({k: v for k, v in flat.items() if k != "rope_theta"}).rope_theta == 10000.0


def test_config_features_map_onto_the_model():
    mixtral = config_from_hf(json.loads((require_fixtures() / "hf" / "tiny-mixtral" / "config.json").read_text()))
    assert (mixtral.n_experts, mixtral.n_experts_per_token, mixtral.tie_embeddings) == (8, 2, False)
    tied = config_from_hf(json.loads((require_fixtures() / "hf" / "tiny-llama-tied" / "config.json").read_text()))
    assert (tied.n_heads, tied.n_kv_heads, tied.tie_embeddings) == (4, 2, True)


def test_unsupported_architecture_is_named():
    with pytest.raises(ImportFormatError, match="GPT2LMHeadModel"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_bfloat16_import_stores_bfloat16_params():
    config, params = load_hf(require_fixtures() / "hf" / "tiny-llama-tied", dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(params)} == {"bfloat16"}
