"""gpt-oss checkpoints with MXFP4 experts (hkserve/checkpoint/mxfp4.py): the codes and their order by hand,
the dequantization bit for bit against transformers' own (tests/fixtures/hf/tiny-gpt-oss-dequantized holds
transformers' expansion of tiny-gpt-oss-mxfp4's blocks; scripts/make_mxfp4_fixture.py), the MXFP4 import equal
to the float one and to transformers' logits, and the quantization configs that are not implemented refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_fixtures import LOCAL_FIXTURES
from safetensors.numpy import load_file
from test_families import full_and_cached_logits

from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.mxfp4 import dequantize_mxfp4
from hkserve.checkpoint.params import ImportFormatError
from hkserve.model.build import build_model

TOL = 1e-4  # of the largest logit, as test_families_local's


def _dir(name: str) -> Path:
    path = LOCAL_FIXTURES / name
    if not (path / "model.safetensors").exists():
        pytest.fail(f"missing fixture {path} (scripts/make_mxfp4_fixture.py remakes it)")
    return path


def test_codes_nibble_order_and_scales_by_hand():
    """E2M1 code 1 = 0.5, 2 = 1, 7 = 6, 15 = -6; the low nibble is the earlier value; scale 127 = x1, 128 = x2,
    0 = x2^-127 (a float32 subnormal, still exact)."""
    blocks = np.zeros((4, 1, 16), np.uint8)
    blocks[:, 0, 0], blocks[:, 0, 15] = 0x21, 0xF7
    scales = np.array([[127], [128], [126], [0]], np.uint8)
    out = dequantize_mxfp4(blocks, scales)  # [4, 32]
    assert out.dtype == np.float32 and out.shape == (4, 32)
    np.testing.assert_array_equal(out[0, [0, 1, 2, 29, 30, 31]], [0.5, 1.0, 0.0, 0.0, 6.0, -6.0])
    np.testing.assert_array_equal(out[:, 0], [0.5, 1.0, 0.25, np.ldexp(np.float32(0.5), -127)])
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte once
    values = dequantize_mxfp4(codes, np.full(16, 127, np.uint8)).reshape(-1)
    assert sorted(set(values.tolist())) == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_dequantization_is_transformers_bit_for_bit_and_exact_in_bfloat16():
    """Every expert tensor of the MXFP4 fixture, expanded here, has the bits of transformers' expansion
    (convert_moe_packed_tensors, float32) of the same blocks; the values survive a bfloat16 round trip."""
    quantized = load_file(_dir("tiny-gpt-oss-mxfp4") / "model.safetensors")
    theirs = load_file(_dir("tiny-gpt-oss-dequantized") / "model.safetensors")
    names = sorted(name.removesuffix("_blocks") for name in quantized if name.endswith("_blocks"))
    assert len(names) == 6  # gate_up_proj and down_proj of 3 layers
    for name in names:
        ours = dequantize_mxfp4(quantized[name + "_blocks"], quantized[name + "_scales"]).swapaxes(1, 2)
        assert ours.shape == theirs[name].shape, name
        np.testing.assert_array_equal(ours.view(np.uint32), theirs[name].view(np.uint32), err_msg=name)
        np.testing.assert_array_equal(ours.astype(jnp.bfloat16).astype(np.float32), ours, err_msg=name)
        assert len(np.unique(quantized[name + "_scales"])) > 3, f"{name}: the fixture's groups share few exponents"


def test_mxfp4_checkpoint_imports_as_its_dequantized_float_one_and_matches_transformers():
    """The same config and bit-equal weights, so bit-equal logits; transformers' logits on the float
    checkpoint (equal to its own on the MXFP4 one) within 1e-4 of the largest, full and cached."""
    config, params = load_hf(_dir("tiny-gpt-oss-mxfp4"))
    float_config, float_params = load_hf(_dir("tiny-gpt-oss-dequantized"))
    assert config == float_config
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), params, float_params)
    assert all(jax.tree_util.tree_leaves(same))
    ref = json.loads((_dir("tiny-gpt-oss-dequantized") / "reference.json").read_text())
    ids = np.asarray(ref["input_ids"], np.int32)
    full, cached = full_and_cached_logits(build_model(config), params, ids)
    float_full, _ = full_and_cached_logits(build_model(float_config), float_params, ids)
    np.testing.assert_array_equal(full, float_full)
    for ours, key in ((full, "logits"), (cached, "cached_logits")):
        want = np.asarray(ref[key], np.float32)
        np.testing.assert_allclose(ours, want, atol=TOL * np.abs(want).max(), rtol=0, err_msg=key)


def test_quantization_configs_and_blocks_not_implemented_are_refused(tmp_path):
    cfg = json.loads((_dir("tiny-gpt-oss-mxfp4") / "config.json").read_text())
    assert config_from_hf(cfg) == config_from_hf({k: v for k, v in cfg.items() if k != "quantization_config"})
    for method in ("gptq", "awq", "fp8", "bitsandbytes", None):
        with pytest.raises(ImportFormatError, match=f"quant_method {method!r} is not supported"):
            config_from_hf({**cfg, "quantization_config": {"quant_method": method}})
    with pytest.raises(ImportFormatError, match=r"field\(s\) \['group_size'\]"):
        config_from_hf({**cfg, "quantization_config": {**cfg["quantization_config"], "group_size": 64}})
    llama = json.loads((LOCAL_FIXTURES / "tiny-rope-linear" / "config.json").read_text())
    with pytest.raises(ImportFormatError, match="quant_method 'mxfp4' is not supported"):
        config_from_hf({**llama, "quantization_config": {"quant_method": "mxfp4"}})
    blocks, scales = np.zeros((2, 1, 16), np.uint8), np.full((2, 1), 127, np.uint8)
    with pytest.raises(ImportFormatError, match="scale 255"):
        dequantize_mxfp4(blocks, np.full((2, 1), 255, np.uint8))
    with pytest.raises(ImportFormatError, match="must be uint8"):
        dequantize_mxfp4(blocks.astype(np.float32), scales)
    with pytest.raises(ImportFormatError, match="do not fit"):
        dequantize_mxfp4(np.zeros((2, 1, 8), np.uint8), scales)
    no_config = tmp_path / "no-config"  # MXFP4 tensors under a config that does not say so: unused, refused
    shutil.copytree(_dir("tiny-gpt-oss-mxfp4"), no_config)
    (no_config / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(ImportFormatError, match="missing tensor model.layers.0.mlp.experts"):
        load_hf(no_config)
