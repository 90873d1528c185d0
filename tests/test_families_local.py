"""The RoPE scaling types and the families whose fixtures live in this repository (tests/fixtures/hf,
remade by scripts/make_family_fixtures.py) against the logits transformers computed: full forward,
the cached path (4-token prefill, then one token per step) and greedy decoding through the Engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_fixtures import LOCAL, local_fixture
from test_families import engine_greedy, full_and_cached_logits

from hkserve.checkpoint.hf import load_hf
from hkserve.model.build import build_model

TOL = 1e-4  # relative to the largest reference logit


@pytest.mark.parametrize("name", LOCAL)
def test_full_cached_and_engine_greedy_match_transformers(name):
    path = local_fixture(name)
    ref = json.loads((path / "reference.json").read_text())
    config, params = load_hf(path)
    model = build_model(config)
    ids = np.asarray(ref["input_ids"], np.int32)
    want = np.asarray(ref["logits"], np.float32)
    full, cached = full_and_cached_logits(model, params, ids)
    atol = TOL * np.abs(want).max()
    np.testing.assert_allclose(full, want, atol=atol, rtol=0, err_msg="full forward")
    np.testing.assert_allclose(cached, want, atol=atol, rtol=0, err_msg="cached path")
    assert engine_greedy(model, params, ref["greedy_prompt"], len(ref["greedy_ids"])) == ref["greedy_ids"]
