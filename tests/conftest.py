"""pytest fixtures only (shared helpers live in helpers.py): the golden SmolLM2 outputs and a SmolLM2
store pulled once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import hkserve, require_fixtures

from hkserve.checkpoint.store import ModelStore


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads((require_fixtures() / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_home(tmp_path_factory) -> Path:
    """An HKSERVE_HOME into which `hkserve pull` fetched and converted the default model; or, where
    HKSERVE_TEST_HOME is set (machines without network: scripts/device-check.sh), that store, which must
    hold the model already."""
    if os.environ.get("HKSERVE_TEST_HOME"):
        home = Path(os.environ["HKSERVE_TEST_HOME"])
        assert (home / "models" / "smollm2-135m-instruct" / "config.json").is_file(), f"no SmolLM2 in {home}"
        return home
    home = tmp_path_factory.mktemp("hkhome")
    result = hkserve("pull", "--quiet", home=home)
    assert (home / "models" / "smollm2-135m-instruct" / "config.json").is_file(), result.stderr
    return home


@pytest.fixture(scope="session")
def smollm2(smollm2_home):
    """(store, model info, tokenizer, params) of the pulled SmolLM2."""

    store = ModelStore(smollm2_home)
    name = "smollm2-135m-instruct"
    return store, store.info(name), store.tokenizer(name), store.params(name)
