"""The model-family fixtures of ../shared/fixtures (hf/ and gguf/), shared by the test_families*
files. A missing fixture fails the test that needs it (it is never skipped)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import FIXTURES

from hkserve.model.memory import init_memory

HF = [
    "tiny-llama-tied",
    "tiny-llama-untied",
    "tiny-mixtral",
    "tiny-llama3-rope",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral-swa",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
]
GGUF = ["tiny-llama3-rope", "tiny-qwen2", "tiny-qwen3", "tiny-mistral-swa", "tiny-gemma2", "tiny-gemma3", "tiny-phi3"]
SLIDING = ["tiny-mistral-swa", "tiny-gemma2", "tiny-gemma3"]


def fixture(*parts: str) -> Path:
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"missing fixture {path} (set HKSERVE_SHARED to the shared directory)")
    return path


def reference(name: str, file: str = "reference.json", kind: str = "hf") -> dict:
    return json.loads(fixture(kind, name, file).read_text())


@functools.cache
def jitted_forward(model):
    return jax.jit(model.forward, static_argnums=(5, 6))


def full_logits(model, params, ids) -> np.ndarray:
    """[B, T, V] logits of the whole of `ids` [B, T] in one forward on an empty memory."""
    ids = np.asarray(ids, np.int32)
    memory = init_memory(model.config, ids.shape[0], ids.shape[1])
    lengths = np.full(ids.shape[0], ids.shape[1], np.int32)
    return np.asarray(jitted_forward(model)(params, ids, memory, lengths, None, ids.shape[1], False)[0])
