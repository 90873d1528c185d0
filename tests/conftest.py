"""Shared test fixtures: paths to ../shared reference data and a SmolLM2 store pulled once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HKSERVE_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"


def require_fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"reference fixtures not found at {FIXTURES} (set HKSERVE_SHARED)")
    return FIXTURES


def hkserve(*args: str, home: Path, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess with its own model store."""
    env = {**os.environ, "HKSERVE_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "hkserve.cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode:
        raise AssertionError(f"hkserve {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


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
    from hkserve.checkpoint.store import ModelStore

    store = ModelStore(smollm2_home)
    name = "smollm2-135m-instruct"
    return store, store.info(name), store.tokenizer(name), store.params(name)
