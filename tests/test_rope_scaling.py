"""What the RoPE scaling types linear, dynamic, yarn and longrope (hkserve/checkpoint/rope_scaling.py)
set, cap and refuse; their logits against transformers are test_families_local.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from family_fixtures import fixture, local_fixture

from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_reader import open_gguf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.params import ImportFormatError


def _config(name: str) -> dict:
    return json.loads((local_fixture(name) / "config.json").read_text())


def test_scaling_factors_and_context_caps():
    """The numbers each type sets, beside the logits: linear divides every frequency, yarn scales
    cos/sin by 0.1 ln(factor) + 1, longrope by sqrt(1 + ln(factor) / ln(original)) and serves only
    the original context (past it transformers switches every position to long_factor), dynamic
    serves max_position_embeddings (past it its frequencies change with the length)."""
    linear = config_from_hf(_config("tiny-rope-linear"))
    assert linear.rope_freq_factors == (4.0,) * 8 and linear.rope_attn_factor == 1.0 and linear.context_length == 64
    yarn = config_from_hf(_config("tiny-rope-yarn"))
    assert yarn.rope_attn_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert yarn.rope_freq_factors[0] == pytest.approx(1.0) and yarn.rope_freq_factors[-1] == pytest.approx(4.0)
    longrope = config_from_hf(_config("tiny-rope-longrope"))
    assert longrope.context_length == 16
    assert longrope.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(16)))
    assert config_from_hf(_config("tiny-rope-dynamic")).context_length == 64


def test_unknown_types_and_per_layer_differences_are_refused():
    cfg = _config("tiny-rope-linear")
    with pytest.raises(ImportFormatError, match="'proportional' is not supported"):
        config_from_hf({**cfg, "rope_parameters": {"rope_type": "proportional", "factor": 2.0}})
    with pytest.raises(ImportFormatError, match="lacks its parameter 'factor'"):
        config_from_hf({**cfg, "rope_parameters": {"rope_type": "linear"}})
    with pytest.raises(ImportFormatError, match=r"RoPE parameter\(s\) \['alpha'\]"):
        config_from_hf({**cfg, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "alpha": 1.0}})


def test_gemma3_scaling_on_full_layers_only_is_refused():
    """Gemma 3 4B+ scales only its full layers (linear, factor 8); the decoder applies one scaling to
    every layer, so that stays refused rather than applied to the sliding layers too."""
    cfg = json.loads(fixture("hf", "tiny-gemma3", "config.json").read_text())
    params = {**cfg["rope_parameters"]}
    params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": 8.0}
    with pytest.raises(ImportFormatError, match="differs between full and sliding layers"):
        config_from_hf({**cfg, "rope_parameters": params})


def _gguf(path: Path, arch: str, keys: dict, tensors: dict | None = None) -> Path:
    """A GGUF of metadata ({key after "arch.": value}, a 64-position context) and perhaps some 1-D tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_vocab_size(256)
    w.add_context_length(64)
    add = {float: w.add_float32, int: w.add_uint32, str: w.add_string}
    for key, value in keys.items():
        add[type(value)](f"{arch}.{key}", value)
    for name, values in (tensors or {}).items():
        w.add_tensor(name, np.asarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_gguf(path: Path, scaling: str, factor: float) -> Path:
    """A llama GGUF of metadata only, with llama.cpp's converter's rope.scaling keys."""
    keys = {"rope.scaling.type": scaling, "rope.scaling.factor": factor, "rope.scaling.original_context_length": 512}
    return _gguf(path, "llama", keys)


def test_gguf_linear_and_yarn_scaling_import(tmp_path):
    """llama.cpp applies linear scaling as freq_scale = 1 / factor on every frequency; its YaRN is
    transformers' (checked against llama.cpp on tests/fixtures/gguf/tiny-rope-yarn)."""
    config = config_from_gguf(open_gguf(_llama_gguf(tmp_path / "linear.gguf", "linear", 4.0)))
    assert config.rope_freq_factors == (4.0,) * 8 and config.rope_attn_factor == 1.0
    yarn = config_from_gguf(open_gguf(_llama_gguf(tmp_path / "yarn.gguf", "yarn", 4.0)))
    assert yarn.rope_attn_factor == pytest.approx(1 + 0.1 * math.log(4.0))
    assert yarn.rope_freq_factors[0] == 1.0 and yarn.rope_freq_factors[-1] == pytest.approx(4.0)


def _phi3_longrope_gguf(path: Path, keys: dict, tensors: dict) -> Path:
    """A phi3 GGUF of metadata only plus LongRoPE's factor tensors, as llama.cpp's converter writes them."""
    return _gguf(path, "phi3", keys, tensors)


LONG, SHORT = [1.0, 2, 4, 8, 8, 8, 8, 8], [1.0, 1.5, 2, 2, 3, 3, 4, 4]
LONGROPE_KEYS = {"rope.scaling.original_context_length": 16, "rope.scaling.attn_factor": 1.25}
LONGROPE_TENSORS = {"rope_factors_long.weight": LONG, "rope_factors_short.weight": SHORT}


def test_gguf_longrope_factors_follow_the_context_served_and_what_the_file_lacks_is_refused(tmp_path):
    """llama.cpp takes the long factors once the context it serves passes the original (the file's own
    context by default), else the short ones (this server then caps there, as for HF); the cos/sin factor
    is the file's. Without both tensors, the original context or the factor the import is refused; a llama
    file saying longrope without tensors too (llama.cpp has none for it)."""
    path = _phi3_longrope_gguf(tmp_path / "lr.gguf", LONGROPE_KEYS, LONGROPE_TENSORS)
    served = config_from_gguf(open_gguf(path))
    assert (served.rope_freq_factors, served.rope_attn_factor, served.context_length) == (tuple(LONG), 1.25, 64)
    for context in (16, 8):
        short = config_from_gguf(open_gguf(path), context_length=context)
        assert (short.rope_freq_factors, short.rope_attn_factor, short.context_length) == (tuple(SHORT), 1.25, context)
    assert config_from_gguf(open_gguf(path), context_length=17).rope_freq_factors == tuple(LONG)
    assert config_from_gguf(open_gguf(path), context_length=1000).context_length == 64  # never past the file's
    for i, lacking in enumerate(LONGROPE_TENSORS):
        tensors = {k: v for k, v in LONGROPE_TENSORS.items() if k != lacking}
        with pytest.raises(ImportFormatError, match="needs both tensors"):
            config_from_gguf(open_gguf(_phi3_longrope_gguf(tmp_path / f"t{i}.gguf", LONGROPE_KEYS, tensors)))
    for i, lacking in enumerate(LONGROPE_KEYS):
        keys = {k: v for k, v in LONGROPE_KEYS.items() if k != lacking}
        with pytest.raises(ImportFormatError, match=f"lacks phi3.{lacking}"):
            config_from_gguf(open_gguf(_phi3_longrope_gguf(tmp_path / f"k{i}.gguf", keys, LONGROPE_TENSORS)))
    with pytest.raises(ImportFormatError, match="longrope needs both tensors"):
        config_from_gguf(open_gguf(_llama_gguf(tmp_path / "longrope.gguf", "longrope", 4.0)))
    with pytest.raises(ImportFormatError, match="attn_factor 1.25 outside longrope"):
        config_from_gguf(open_gguf(_phi3_longrope_gguf(tmp_path / "a.gguf", LONGROPE_KEYS, {})))
