"""Every GGUF fixture (llama.cpp's own converter output for each family; Qwen2-MoE and Qwen3-MoE from
tests/fixtures/gguf) through `convert` into a store: logits equal transformers' for the same weights, the
q8_0 file is near llama.cpp's own logits, and greedy text generation runs with the GGUF's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from family_fixtures import GGUF, LOCAL_GGUF, fixture, full_logits, local_fixture, local_gguf, reference

from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model

# (bos, eos) as llama.cpp's converter wrote them (Qwen's HF configs have none, Phi-3's EOS is out of vocabulary)
SPECIALS = {
    "tiny-gemma2": (2, 1),
    "tiny-gemma3": (2, 1),
    "tiny-phi3": (1, None),
    "tiny-qwen2": (None, None),
    "tiny-qwen3": (None, None),
    "tiny-qwen2-moe": (None, None),
    "tiny-qwen3-moe": (None, None),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ModelStore:
    return ModelStore(tmp_path_factory.mktemp("gguf-home"))


def converted(store: ModelStore, source: Path, file: str):
    if not store.exists(file):
        convert(source, file, store, progress=False)
    info = store.info(file)
    return build_model(info.config), store.params(file), store.tokenizer(file)


def gguf_case(name: str) -> tuple[Path, dict, float]:
    """(the GGUF file, the reference its logits must match, their tolerance)."""
    if name in LOCAL_GGUF:  # tests/fixtures: the HF fixture of the same weights
        return local_gguf(name), json.loads((local_fixture(name) / "reference.json").read_text()), 1e-4
    if name == "tiny-mistral-swa":  # llama.cpp writes Mistral as plain llama: no window in this file
        return fixture("gguf", name, f"{name}.f32.gguf"), reference(name, "reference_llamacpp.json", kind="gguf"), 1e-3
    return fixture("gguf", name, f"{name}.f32.gguf"), reference(name), 1e-4


@pytest.mark.parametrize("name", GGUF + LOCAL_GGUF)
def test_converted_gguf_matches_reference_and_generates_text(store, name):
    path, ref, atol = gguf_case(name)
    model, params, tokenizer = converted(store, path, path.name)
    logits = full_logits(model, params, ref["input_ids"], pad_to=32)
    print(f"{name}: max |diff| {np.abs(logits - np.asarray(ref['logits'])).max():.2e}")
    np.testing.assert_allclose(logits, np.asarray(ref["logits"]), atol=atol, rtol=0)

    assert (tokenizer.bos_id, tokenizer.eos_id) == SPECIALS.get(name, (1, 2))
    prompt = tokenizer.encode("the quick brown fox")
    assert len(prompt) > 2 and (tokenizer.bos_id is None or prompt[0] == tokenizer.bos_id)
    runner = InferenceRunner(Engine(model, params, EngineOptions(slots=1, max_len=32, prefill_buckets=(16,)))).start(
        warmup=False
    )
    try:
        out = [t.id for t in runner.generate(Request(prompt, 6, stop_ids=tokenizer.stop_ids))]
    finally:
        runner.stop()
    assert out and isinstance(tokenizer.decode(out), str)
    seq = list(prompt)  # greedy = the argmax of a full recompute at each step (two rows: the same compile)
    for _ in out:
        seq.append(int(full_logits(model, params, [seq, seq], pad_to=32)[0, -1].argmax()))
    assert out == seq[len(prompt) : len(prompt) + len(out)]


def test_q8_0_gguf_is_near_llama_cpp(store):
    model, params, _ = converted(store, fixture("gguf", "tiny-qwen2", "tiny-qwen2.q8_0.gguf"), "tiny-qwen2.q8_0.gguf")
    ref = reference("tiny-qwen2", "reference_llamacpp.q8_0.json", kind="gguf")
    logits = full_logits(model, params, ref["input_ids"])
    print(f"q8_0: max |diff| {np.abs(logits - np.asarray(ref['logits'])).max():.2e}")
    np.testing.assert_allclose(logits, np.asarray(ref["logits"]), atol=3e-2, rtol=0)
