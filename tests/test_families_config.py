"""HF/GGUF config reading of the families: both config forms give the same model, and whatever the decoder
does not implement is refused with an error naming it (never imported as if absent)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from family_fixtures import fixture
from safetensors.numpy import save_file

from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.safetensors_dir import INDEX, SafetensorsDir


def hf_config(name: str) -> dict:
    return json.loads(fixture("hf", name, "config.json").read_text())


def test_sliding_windows_rope_bases_and_gemma_options_are_read():
    mistral = config_from_hf(hf_config("tiny-mistral-swa"))
    assert (mistral.sliding_window, mistral.layer_windows()) == (8, (8, 8))
    gemma2 = config_from_hf(hf_config("tiny-gemma2"))
    assert gemma2.layer_windows() == (8, 0, 8, 0)
    assert (gemma2.attn_logit_cap, gemma2.final_logit_cap, gemma2.norm_offset) == (50.0, 30.0, 1.0)
    assert (gemma2.embedding_multiplier, gemma2.attn_multiplier, gemma2.mlp_activation) == (8.0, 0.25, "gelu")
    gemma3 = config_from_hf(hf_config("tiny-gemma3"))
    assert gemma3.layer_windows() == (8, 8, 8, 8, 8, 0)
    assert gemma3.layer_rope_thetas() == (1e4,) * 5 + (1e6,)
    assert config_from_hf(hf_config("tiny-qwen2")).qkv_bias
    qwen3 = config_from_hf(hf_config("tiny-qwen3"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.sliding_window) == (True, 32, 0)


def test_older_top_level_forms_give_the_same_config():
    new = hf_config("tiny-gemma3")
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6}
    assert config_from_hf(old) == config_from_hf(new)
    gemma2 = hf_config("tiny-gemma2")
    assert config_from_hf({k: v for k, v in gemma2.items() if k != "layer_types"}) == config_from_hf(gemma2)
    llama3 = hf_config("tiny-llama3-rope")
    flat = {k: v for k, v in llama3.items() if k != "rope_parameters"}
    flat |= {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in llama3["rope_parameters"].items()}}
    assert config_from_hf(flat) == config_from_hf(llama3)


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("tiny-llama3-rope", {"rope_parameters": {"rope_type": "proportional", "factor": 2.0}}, "'proportional'"),
        ("tiny-llama3-rope", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' lacks"),
        ("tiny-llama-tied", {"attention_bias": True}, "attention_bias"),
        ("tiny-llama-tied", {"hidden_act": "relu"}, "'relu'"),
        ("tiny-llama-tied", {"some_new_switch": True}, "some_new_switch"),
        ("tiny-phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("tiny-gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("tiny-gemma2", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ],
)
def test_what_the_decoder_does_not_implement_is_refused(name, change, named):
    with pytest.raises(ImportFormatError, match=named):
        config_from_hf(hf_config(name) | change)


def test_a_tensor_no_mapping_uses_is_refused(tmp_path):
    source = fixture("hf", "tiny-llama-tied")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = {name: SafetensorsDir(source).get(name) for name in SafetensorsDir(source).unread}
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ImportFormatError, match="o_proj.bias"):
        load_hf(tmp_path)


def test_sharded_checkpoint_with_index_loads_like_one_file(tmp_path):
    source = fixture("hf", "tiny-gemma3")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    whole = SafetensorsDir(source)
    names = sorted(whole.unread)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for file, part in shards.items():
        save_file({n: whole.get(n) for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config, params = load_hf(tmp_path)
    want_config, want = load_hf(source)
    assert config == want_config
    for module, leaves in want.items():
        for leaf, value in leaves.items():
            np.testing.assert_array_equal(params[module][leaf], value, err_msg=f"{module}/{leaf}")
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ImportFormatError, match="model-00002-of-00003"):
        load_hf(tmp_path)


def test_qwen_window_only_with_use_sliding_window():
    base = {k: v for k, v in hf_config("tiny-qwen2").items() if k != "layer_types"} | {"sliding_window": 4}
    assert config_from_hf(base).sliding_window == 0
    on = config_from_hf(base | {"use_sliding_window": True, "max_window_layers": 1})
    assert on.layer_windows() == (0, 4)
