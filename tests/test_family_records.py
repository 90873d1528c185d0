"""The family records of checkpoint/families.py: a new family is one record (registered, never an
importer edit), and a record asking for what the importers do not implement is refused."""

from __future__ import annotations

import json

import gguf
import jax
import numpy as np
import pytest
from family_fixtures import HF, fixture, full_logits, reference
from safetensors.numpy import save_file

from hkserve.checkpoint import families
from hkserve.checkpoint.families import HF_NAMES, LLAMA, PHI3, hf_family, register
from hkserve.checkpoint.family import Family
from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_reader import open_gguf
from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.hf_write import hf_checkpoint_tensors, hf_config_dict
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.safetensors_dir import SafetensorsDir
from hkserve.model.build import build_model

# A renamed Llama: its own architecture name, layer prefix and fused q|k|v and gate|up tensors.
RENAMED_NAMES = HF_NAMES.replace(
    layer_prefix="blocks.{i}.",
    embed="tok_embeddings.weight",
    final_norm="norm.weight",
    qkv_proj="attn.wqkv.weight",
    o_proj="attn.wo.weight",
    gate_up_proj="ffn.w13.weight",
    down_proj="ffn.w2.weight",
)
RENAMED = Family("renamed-llama", {}, hf=RENAMED_NAMES, hf_architectures=("RenamedLlamaForCausalLM",))


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))  # the registry comes back after
    return register(RENAMED)


def hf_config(name: str) -> dict:
    return json.loads(fixture("hf", name, "config.json").read_text())


def write_renamed(source, target) -> None:
    """tiny-llama-tied's checkpoint under RENAMED's names."""
    cfg = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(cfg | {"architectures": ["RenamedLlamaForCausalLM"]}))
    t = SafetensorsDir(source)
    out = {"tok_embeddings.weight": t.get("model.embed_tokens.weight"), "norm.weight": t.get("model.norm.weight")}
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "input_layernorm.weight"] = t.get(p + "input_layernorm.weight")
        out[q + "post_attention_layernorm.weight"] = t.get(p + "post_attention_layernorm.weight")
        out[q + "attn.wqkv.weight"] = np.concatenate([t.get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        out[q + "attn.wo.weight"] = t.get(p + "self_attn.o_proj.weight")
        out[q + "ffn.w13.weight"] = np.concatenate([t.get(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
        out[q + "ffn.w2.weight"] = t.get(p + "mlp.down_proj.weight")
    save_file(out, str(target / "model.safetensors"))


def test_a_registered_record_imports_its_checkpoint_with_no_importer_change(registered, tmp_path):
    source = fixture("hf", "tiny-llama-tied")
    write_renamed(source, tmp_path)
    config, params = load_hf(tmp_path)
    want_config, want = load_hf(source)
    assert config == want_config
    jax.tree.map(np.testing.assert_array_equal, params, want)
    ref = reference("tiny-llama-tied")
    logits = full_logits(build_model(config), params, ref["input_ids"])
    np.testing.assert_allclose(logits, np.asarray(ref["logits"]), atol=1e-4, rtol=0)


def test_an_unregistered_architecture_is_refused_by_name(tmp_path):
    write_renamed(fixture("hf", "tiny-llama-tied"), tmp_path)
    with pytest.raises(ImportFormatError, match="RenamedLlamaForCausalLM"):
        load_hf(tmp_path)


def test_every_hf_fixture_maps_to_the_record_of_its_architecture():
    for name in HF:
        cfg = json.loads(fixture("hf", name, "config.json").read_text())
        family = hf_family(cfg["architectures"][0])
        assert cfg["model_type"].startswith(family.name), name  # gemma3: "gemma3_text"
        assert config_from_hf(cfg).qkv_bias == bool(family.options.get("qkv_bias")), name
    with pytest.raises(ValueError, match="already registered"):
        register(LLAMA)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"options": {"rope_kind": "yarn"}}, "rope_kind"),
        ({"options": {"sandwich_norms": True}}, "sandwich_norms"),
        ({"options": {"qkv_bias": True}, "hf": PHI3.hf}, "fused qkv"),
        ({"activation_option": "attn_activation"}, "attn_activation"),
        ({"hf_activations": ("relu",)}, "relu"),
        ({"sliding_pattern": 2, "sliding_opt_in": True}, "sliding"),
        ({"hf": None}, "HF architectures"),
        ({"gguf": None}, "GGUF architecture"),
    ],
)
def test_a_record_asking_for_what_is_not_implemented_is_refused(changes, named):
    fields = {"name": "odd", "options": {}, "hf": LLAMA.hf, "gguf": LLAMA.gguf} | changes
    fields |= {"hf_architectures": ("OddForCausalLM",), "gguf_architecture": "odd"}
    with pytest.raises(ValueError, match=named):
        Family(**fields)


def test_fused_rows_stored_in_out_are_refused():
    with pytest.raises(ValueError, match="fused"):
        HF_NAMES.replace(out_in=False, qkv_proj="qkv")


def test_a_record_reading_a_config_key_no_code_reads_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    register(Family("keyed", {}, hf=HF_NAMES, hf_architectures=("KeyedForCausalLM",), hf_keys=frozenset({"alibi"})))
    cfg = json.loads(fixture("hf", "tiny-llama-tied", "config.json").read_text())
    with pytest.raises(ImportFormatError, match="alibi"):
        config_from_hf(cfg | {"architectures": ["KeyedForCausalLM"], "alibi": True})


@pytest.mark.parametrize("name", ["tiny-llama-untied", "tiny-mixtral"])
def test_hf_write_gives_back_the_checkpoint_hf_import_read(name):
    source = fixture("hf", name)
    config, params = load_hf(source)
    assert config_from_hf(hf_config_dict(config)) == config
    written, t = hf_checkpoint_tensors(config, params), SafetensorsDir(source)
    assert set(written) == set(t.unread)
    for tensor, value in written.items():
        np.testing.assert_array_equal(value, t.get(tensor), err_msg=tensor)


def test_what_the_gemma_records_fill_in_when_config_json_is_silent():
    cfg = {k: v for k, v in hf_config("tiny-gemma3").items() if k not in ("rope_parameters", "tie_word_embeddings")}
    config = config_from_hf(cfg)
    assert (config.rope_theta, config.rope_local_theta, config.tie_embeddings) == (1e6, 1e4, True)


def metadata_only_gguf(path, arch: str, n_layers: int) -> None:
    """A GGUF file of metadata only (config_from_gguf reads no tensor but rope_freqs)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_rope_dimension_count(32)
    w.add_vocab_size(256)
    w.add_sliding_window(8)
    w.add_rope_freq_base_swa(5000.0)
    w.add_attn_logit_softcapping(50.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "n_layers", "scale_dim", "local_theta", "windows"),
    [
        ("gemma2", 46, 16, 0.0, (8, 0)),  # llama.cpp: dim/heads for Gemma 2 27B's 46 layers
        ("gemma2", 4, 32, 0.0, (8, 0)),
        ("gemma3", 62, 16, 5000.0, (8, 8, 8, 8, 8, 0)),
        ("gemma3", 6, 32, 5000.0, (8, 8, 8, 8, 8, 0)),
    ],
)
def test_what_the_gemma_records_fill_in_from_gguf_metadata(tmp_path, arch, n_layers, scale_dim, local_theta, windows):
    metadata_only_gguf(tmp_path / "m.gguf", arch, n_layers)
    config = config_from_gguf(open_gguf(tmp_path / "m.gguf"))
    assert config.attn_multiplier == scale_dim**-0.5
    assert (config.rope_local_theta, config.attn_logit_cap, config.embedding_multiplier) == (local_theta, 50.0, 8.0)
    assert config.layer_windows()[: len(windows)] == windows


def test_a_gguf_window_the_record_does_not_import_is_refused(tmp_path):
    metadata_only_gguf(tmp_path / "m.gguf", "qwen2", 2)
    with pytest.raises(ImportFormatError, match="sliding window"):
        config_from_gguf(open_gguf(tmp_path / "m.gguf"))
