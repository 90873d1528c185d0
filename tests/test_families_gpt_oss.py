"""gpt-oss beyond the shared fixture checks of test_families_local.py: its attention sinks are not in the
CPU decode-attention kernel, so with the kernels on it decodes through XLA's attention; what its record
does not implement (other biases, a GGUF file) is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from family_fixtures import local_fixture
from test_families import full_and_cached_logits

from hkserve.checkpoint.families import gguf_family
from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.hf_write import hf_writable
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.quantize import convert_params
from hkserve.kernels import dispatch
from hkserve.model import attention
from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig

NAME = "tiny-gpt-oss"


def _fixture() -> tuple[dict, dict]:
    path = local_fixture(NAME)
    return json.loads((path / "config.json").read_text()), json.loads((path / "reference.json").read_text())


def test_config_reads_every_gpt_oss_option():
    cfg, _ = _fixture()
    config = config_from_hf(cfg)
    assert (config.attn_sinks, config.qkv_bias, config.o_bias, config.moe_biases) == (True,) * 4
    assert (config.moe_activation, config.swiglu_limit, config.swiglu_alpha) == ("clamped_swiglu", 0.5, 1.702)
    assert (config.n_experts, config.n_experts_per_token, config.moe_routing) == (4, 2, "mixtral")
    assert (config.sliding_window, config.sliding_layers) == (4, (True, False, True))
    assert config.rope_attn_factor > 1.0 and config.rope_freq_factors[-1] == 4.0  # yarn
    unbiased = config_from_hf(cfg | {"attention_bias": False})
    assert not (unbiased.qkv_bias or unbiased.o_bias)
    del cfg["layer_types"]  # transformers' default: alternating, sliding first
    assert config_from_hf({**cfg, "num_hidden_layers": 4}).sliding_layers == (True, False) * 2


def test_the_hf_writer_refuses_each_gpt_oss_option():
    """hf_write.py writes Llama/Mixtral tensors: a config with any of gpt-oss's options is not writable."""
    cfg, _ = _fixture()
    plain = {"qkv_bias": False, "o_bias": False, "attn_sinks": False, "moe_biases": False, "moe_activation": "silu"}
    plain |= {"swiglu_limit": 0.0, "swiglu_alpha": 0.0, "sliding_window": 0, "sliding_layers": ()}
    mixtral_like = config_from_hf(cfg).replace(**plain, rope_freq_factors=(), rope_attn_factor=1.0)
    assert hf_writable(mixtral_like)
    clamped = {"moe_activation": "clamped_swiglu", "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
    for change in ({"o_bias": True}, {"attn_sinks": True}, {"moe_biases": True}, clamped):
        assert not hf_writable(mixtral_like.replace(**change)), change


def test_cpu_kernels_leave_the_sink_attention_to_xla(monkeypatch):
    """int8 weights through the CPU kernels: the decode steps must not call the decode-attention kernel
    (it has no sinks), and still match transformers within the int8 tolerance of the other families."""
    _, ref = _fixture()
    config, params = load_hf(local_fixture(NAME))
    int8_config, int8 = convert_params(params, config, "int8")
    ids = np.asarray(ref["input_ids"], np.int32)
    kernels = dispatch.resolve("auto", "int8")
    assert kernels is not None
    model = build_model(int8_config, kernels, "scan")

    def no_sinks(*args, **kwargs):
        raise AssertionError("the decode-attention kernel has no attention sinks")

    monkeypatch.setattr(attention.ffi, "decode_attention", no_sinks)
    _, cached = full_and_cached_logits(model, model.prepare(int8), ids)
    want = np.asarray(ref["cached_logits"], np.float32)
    np.testing.assert_allclose(cached, want, atol=2e-2 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ],
)
def test_gpt_oss_fields_the_decoder_does_not_implement_are_refused(change, named):
    cfg, _ = _fixture()
    with pytest.raises(ImportFormatError, match=named):
        config_from_hf(cfg | change)


def test_biases_the_config_turns_off_but_the_file_holds_are_refused(tmp_path):
    """attention_bias false: the q/k/v/o bias tensors in the file are not read, and not silently dropped."""
    cfg, _ = _fixture()
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"attention_bias": False}))
    shutil.copy(local_fixture(NAME) / "model.safetensors", tmp_path)
    with pytest.raises(ImportFormatError, match=r"self_attn\.k_proj\.bias"):
        load_hf(tmp_path)


def test_clamped_swiglu_needs_its_constants_and_gguf_is_refused():
    base = dict(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8, n_experts=2)
    with pytest.raises(ValueError, match="clamped_swiglu"):
        ModelConfig(**base, moe_activation="clamped_swiglu", swiglu_alpha=1.702)
    with pytest.raises(ValueError, match="clamped_swiglu"):
        ModelConfig(**base, swiglu_limit=7.0, swiglu_alpha=1.702)  # the constants without the activation
    with pytest.raises(ImportFormatError, match="'gpt-oss'"):
        # no fixture: the pinned converter (llama.cpp 0c1e5709) has no gpt-oss class; its files hold MXFP4 experts
        gguf_family("gpt-oss")
