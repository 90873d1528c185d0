"""The model-family fixtures of ../shared/fixtures (hf/ and gguf/) and tests/fixtures/hf, shared by the test_families*
files. A missing fixture fails the test that needs it (it is never skipped)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FIXTURES

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
# In this repository (tests/fixtures/hf, remade by scripts/make_family_fixtures.py): RoPE types, new families.
LOCAL = [
    "tiny-rope-linear",
    "tiny-rope-dynamic",
    "tiny-rope-yarn",
    "tiny-rope-longrope",
    "tiny-granite",
    "tiny-olmo2",
    "tiny-smollm3",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-gpt-oss",
]
LOCAL_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# llama.cpp's converter on some of those (tests/fixtures/gguf, remade by scripts/make_family_gguf.py), each
# with llama.cpp's own logits (reference_llamacpp.json, scripts/record_llama_logits.py)
LOCAL_GGUF = [
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-granite",
    "tiny-olmo2",
    "tiny-smollm3",
    "tiny-rope-linear",
    "tiny-rope-yarn",
    "tiny-smollm3-4",
    "tiny-rope-longrope",
]
# those of LOCAL_GGUF with no HF fixture: their transformers reference.json lies beside the GGUF file
GGUF_VARIANTS = ["tiny-smollm3-4"]


def fixture(*parts: str) -> Path:
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"missing fixture {path} (set HKSERVE_SHARED to the shared directory)")
    return path


def local_fixture(name: str) -> Path:
    path = LOCAL_FIXTURES / name
    if not (path / "reference.json").exists():
        pytest.fail(f"missing fixture {path} (scripts/make_family_fixtures.py remakes it)")
    return path


def local_gguf(name: str, file: str = "") -> Path:
    """tests/fixtures/gguf/<name>/<file> (default: the f32 GGUF file)."""
    path = LOCAL_FIXTURES.parent / "gguf" / name / (file or f"{name}.f32.gguf")
    if not path.exists():
        pytest.fail(f"missing fixture {path} (scripts/make_family_gguf.py, record_llama_logits.py remake it)")
    return path


def reference(name: str, file: str = "reference.json", kind: str = "hf") -> dict:
    return json.loads(fixture(kind, name, file).read_text())


@functools.cache
def jitted_forward(model):
    return jax.jit(model.forward, static_argnums=(5, 6))


def full_logits(model, params, ids, pad_to: int = 0) -> np.ndarray:
    """[B, T, V] logits of the whole of `ids` [B, T] in one forward on an empty memory; padded to
    `pad_to` positions (causal attention keeps padding out) so calls of any length share a compile."""
    ids = np.asarray(ids, np.int32)
    b, t = ids.shape
    width = max(t, pad_to)
    tokens = np.zeros((b, width), np.int32)
    tokens[:, :t] = ids
    memory = init_memory(model.config, b, width)
    logits, _ = jitted_forward(model)(params, tokens, memory, np.full(b, t, np.int32), None, width, False)
    return np.asarray(logits)[:, :t]
