"""Every GGUF fixture (llama.cpp's own converter output for each family; Qwen-MoE, Granite, OLMo 2, SmolLM3,
linear, yarn and longrope RoPE from tests/fixtures/gguf) through `convert` into a store: logits equal
transformers' for the same weights and llama.cpp's own for the same file, the q8_0 file is near llama.cpp's,
and greedy text generation runs with the GGUF's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from family_fixtures import GGUF, GGUF_VARIANTS, LOCAL_GGUF, fixture, full_logits, local_fixture, local_gguf, reference

from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_import import load_gguf
from hkserve.checkpoint.gguf_reader import open_gguf
from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model

# (bos, eos) as llama.cpp's converter wrote them (Qwen's HF configs have none, Phi-3's EOS is out of vocabulary,
# tiny-olmo2's config has no BOS and an EOS out of its vocabulary)
SPECIALS = {
    "tiny-gemma2": (2, 1),
    "tiny-gemma3": (2, 1),
    "tiny-phi3": (1, None),
    "tiny-rope-longrope": (1, None),
    "tiny-qwen2": (None, None),
    "tiny-qwen3": (None, None),
    "tiny-qwen2-moe": (None, None),
    "tiny-qwen3-moe": (None, None),
    "tiny-olmo2": (None, None),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ModelStore:
    return ModelStore(tmp_path_factory.mktemp("gguf-home"))


def converted(store: ModelStore, source: Path, file: str):
    if not store.exists(file):
        convert(source, file, store, progress=False)
    info = store.info(file)
    return build_model(info.config), store.params(file), store.tokenizer(file)


def gguf_case(name: str) -> tuple[Path, list[tuple[str, dict, float]]]:
    """(the GGUF file, [(whose, the reference its logits must match, their tolerance)])."""
    if name in LOCAL_GGUF:  # tests/fixtures: llama.cpp's logits (f32 KV cache) and the HF fixture's weights
        llama_cpp = ("llama.cpp", json.loads(local_gguf(name, "reference_llamacpp.json").read_text()), 1e-4)
        if name == "tiny-smollm3":  # no_rope_layers [1, 0] is lost: llama.cpp fixes RoPE off on every 4th layer
            return local_gguf(name), [llama_cpp]
        if name == "tiny-rope-longrope":  # the file's context (64) > original (16): long factors, as llama.cpp's;
            return local_gguf(name), [llama_cpp]  # transformers' are the short ones at 13 tokens (test below)
        hf = local_gguf(name, "reference.json") if name in GGUF_VARIANTS else local_fixture(name) / "reference.json"
        transformers = ("transformers", json.loads(hf.read_text()), 1e-4)
        return local_gguf(name), [transformers, llama_cpp]
    if name == "tiny-mistral-swa":  # llama.cpp writes Mistral as plain llama: no window in this file
        ref = reference(name, "reference_llamacpp.json", kind="gguf")
        return fixture("gguf", name, f"{name}.f32.gguf"), [("llama.cpp", ref, 1e-3)]
    return fixture("gguf", name, f"{name}.f32.gguf"), [("transformers", reference(name), 1e-4)]


@pytest.mark.parametrize("name", GGUF + LOCAL_GGUF)
def test_converted_gguf_matches_reference_and_generates_text(store, name):
    path, refs = gguf_case(name)
    model, params, tokenizer = converted(store, path, path.name)
    for whose, ref, atol in refs:
        logits = full_logits(model, params, ref["input_ids"], pad_to=32)
        print(f"{name} vs {whose}: max |diff| {np.abs(logits - np.asarray(ref['logits'])).max():.2e}")
        np.testing.assert_allclose(logits, np.asarray(ref["logits"]), atol=atol, rtol=0, err_msg=whose)

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


def _moe_gguf(path: Path, arch: str, shared: int) -> Path:
    """A GGUF of metadata only, with the keys llama.cpp's converter writes for Qwen-MoE."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_vocab_size(128)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(24)
    if shared:
        w.add_expert_shared_feed_forward_length(shared)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_qwen_moe_gguf_routing_is_llama_cpps_and_a_shared_expert_needs_its_tensor_names(tmp_path):
    """llama.cpp fixes the routing per architecture (qwen2moe: top-k not renormalised; qwen3moe:
    renormalised); a shared expert where the family has no tensor names for one is refused."""
    qwen2 = config_from_gguf(open_gguf(_moe_gguf(tmp_path / "q2.gguf", "qwen2moe", 40)))
    assert (qwen2.moe_routing, qwen2.shared_expert_dim, qwen2.ffn_dim, qwen2.n_experts) == ("grok", 40, 24, 4)
    qwen3 = config_from_gguf(open_gguf(_moe_gguf(tmp_path / "q3.gguf", "qwen3moe", 0)))
    assert (qwen3.moe_routing, qwen3.shared_expert_dim) == ("mixtral", 0)
    with pytest.raises(ImportFormatError, match="shared expert"):
        config_from_gguf(open_gguf(_moe_gguf(tmp_path / "q3s.gguf", "qwen3moe", 40)))


def _dense_gguf(path: Path, arch: str, n_layers: int, keys: dict[str, float | int | str]) -> Path:
    """A GGUF of metadata only: a dense model of `n_layers`, with `keys` ({key after "arch.": value})."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_vocab_size(128)
    add = {float: w.add_float32, int: w.add_uint32, str: w.add_string}
    for key, value in keys.items():
        add[type(value)](f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


GRANITE_SCALES = {"embedding_scale": 3.0, "attention.scale": 0.25, "residual_scale": 0.5, "logit_scale": 2.5}


def test_granite_gguf_scales_are_its_multipliers_and_another_family_refuses_them(tmp_path):
    """llama.cpp's granite: embeddings x embedding_scale, scores x attention.scale (absent: 1/sqrt(head_dim)),
    sub-blocks x residual_scale, logits / logit_scale. Elsewhere llama.cpp ignores them: refused."""
    config = config_from_gguf(open_gguf(_dense_gguf(tmp_path / "g.gguf", "granite", 2, GRANITE_SCALES)))
    assert (config.embedding_multiplier, config.attn_multiplier) == (3.0, 0.25)
    assert (config.residual_multiplier, config.output_multiplier) == (0.5, 0.4)
    plain = config_from_gguf(open_gguf(_dense_gguf(tmp_path / "p.gguf", "granite", 2, {})))
    assert (plain.embedding_multiplier, plain.attn_multiplier, plain.residual_multiplier) == (1.0, 0.0, 1.0)
    assert plain.output_multiplier == 1.0
    for arch in ("llama", "smollm3", "olmo2"):
        with pytest.raises(ImportFormatError, match="logit_scale"):
            config_from_gguf(open_gguf(_dense_gguf(tmp_path / f"{arch}.gguf", arch, 2, {"logit_scale": 2.5})))


def test_smollm3_gguf_has_no_rope_on_every_4th_layer_as_llama_cpp_fixes_it(tmp_path):
    """The file says nothing (the converter drops no_rope_layers): llama.cpp's step of 4 decides."""
    config = config_from_gguf(open_gguf(_dense_gguf(tmp_path / "s.gguf", "smollm3", 8, {})))
    assert config.rope_layers == (True, True, True, False, True, True, True, False)
    assert config_from_gguf(open_gguf(_dense_gguf(tmp_path / "s2.gguf", "smollm3", 2, {}))).rope_layers == ()
    assert config_from_gguf(open_gguf(_dense_gguf(tmp_path / "l.gguf", "llama", 8, {}))).rope_layers == ()


def test_olmo2_gguf_has_only_after_norms_and_full_width_qk_norms(tmp_path):
    config = config_from_gguf(open_gguf(_dense_gguf(tmp_path / "o.gguf", "olmo2", 2, {})))
    assert (config.pre_norms, config.sandwich_norms, config.qk_norm, config.qk_norm_full) == (False, True, True, True)


YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}


def test_yarn_gguf_keys_whose_meaning_is_unchecked_are_refused(tmp_path):
    """llama.cpp multiplies its own mscale by yarn_attn_factor (transformers' attention_factor replaces
    it) and scales the ramp by yarn_ext_factor: only their neutral values import; the original context
    is required."""
    config = config_from_gguf(open_gguf(_dense_gguf(tmp_path / "y.gguf", "llama", 2, {**YARN})))
    assert config.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(4.0))
    neutral = {"rope.scaling.yarn_attn_factor": 1.0, "rope.scaling.yarn_ext_factor": 1.0}
    assert config_from_gguf(open_gguf(_dense_gguf(tmp_path / "n.gguf", "llama", 2, {**YARN, **neutral}))) == config
    for key, value in [("yarn_attn_factor", 1.5), ("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.1)]:
        with pytest.raises(ImportFormatError, match=key):
            config_from_gguf(
                open_gguf(_dense_gguf(tmp_path / f"{key}.gguf", "llama", 2, {**YARN, f"rope.scaling.{key}": value}))
            )
    no_context = {k: v for k, v in YARN.items() if "original" not in k}
    with pytest.raises(ImportFormatError, match="original_context_length"):
        config_from_gguf(open_gguf(_dense_gguf(tmp_path / "c.gguf", "llama", 2, no_context)))
    with pytest.raises(ImportFormatError, match="longrope"):
        config_from_gguf(open_gguf(_dense_gguf(tmp_path / "l.gguf", "llama", 2, {"rope.scaling.type": "longrope"})))


def test_longrope_gguf_served_within_the_original_context_is_the_hf_import():
    """Served at its original context (16), the longrope GGUF takes the short factors and the file's cos/sin
    factor: the HF import of the same checkpoint, so transformers' logits (its 13 tokens are within 16)."""
    name = "tiny-rope-longrope"
    config, params, _ = load_gguf(local_gguf(name), context_length=16)
    hf_config, hf_params = load_hf(local_fixture(name))
    assert config.context_length == hf_config.context_length == 16
    np.testing.assert_allclose(config.rope_freq_factors, hf_config.rope_freq_factors, rtol=1e-7)
    assert config.rope_attn_factor == pytest.approx(hf_config.rope_attn_factor, rel=1e-7)
    ref = json.loads((local_fixture(name) / "reference.json").read_text())
    ours = full_logits(build_model(config), params, ref["input_ids"], pad_to=32)
    hf = full_logits(build_model(hf_config), hf_params, ref["input_ids"], pad_to=32)
    np.testing.assert_allclose(ours, hf, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, np.asarray(ref["logits"]), atol=1e-4, rtol=0)
