"""pytest plugin for `make mutate` only (pyproject's [tool.mutmut] loads it).

While mutmut records which tests reach which function, it forgets JAX's traces before each test.
mutmut records a call through its trampoline; a jitted function runs its Python body only while JAX
traces it, and a later test with the same shapes reuses that trace. Without this, such a later test
would never be run against the function's mutants.

Every mutant's test run shares one persistent compilation cache (mutants/.jax-cache, also named in
HKSERVE_COMPILE_CACHE so that tests/conftest.py's per-run cache does not replace it). A mutant of
host-side code (validation, settings) lowers to the same program as the original, so its run loads
the compiled program instead of compiling it again. A mutant of device code lowers to a different
program, and so misses the cache.

A mutant's tests run fastest first: pytest stops at the first failure (-x), and most mutants fail a
validation test that takes milliseconds before the tests that compile take seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import pytest

# mutmut runs in mutants/. conftest's session cache keeps a HKSERVE_COMPILE_CACHE set before it: this one.
os.environ["HKSERVE_COMPILE_CACHE"] = str(Path(".jax-cache").resolve())
jax.config.update("jax_compilation_cache_dir", os.environ["HKSERVE_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _fresh_jax_traces():
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        jax.clear_caches()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("MUTANT_UNDER_TEST", "stats") == "stats":
        return
    try:  # what mutmut measured on its stats run (cwd is mutants/)
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
