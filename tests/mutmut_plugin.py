"""pytest plugin for `make mutate` only (pyproject's [tool.mutmut] loads it): while mutmut records
which tests reach which function, forget JAX's traces before each test.

mutmut records a call through its trampoline; a jitted function runs its Python body only while JAX
traces it, and a later test with the same shapes reuses that trace. Without this, such a later test
would never be run against the function's mutants."""

from __future__ import annotations

import os

import jax
import pytest


@pytest.fixture(autouse=True)
def _fresh_jax_traces():
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        jax.clear_caches()
