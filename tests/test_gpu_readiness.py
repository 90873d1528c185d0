"""What a GPU host gets without owning one here: bf16 by default on accelerators (chosen by backend name),
variants from a bfloat16 master, real-shape random weights made in bf16, and a warm-up that compiles
everything many slots and long prompts need, once."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config, tiny_vq_config

from hkserve.bench.random_models import RANDOM_CONFIGS, random_config, random_params
from hkserve.checkpoint.quantize import convert_params
from hkserve.checkpoint.store import ModelStore
from hkserve.cli.loading import LoadOptions, load_engine, serving_weights
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import Reuse
from hkserve.model.build import build_model
from hkserve.model.config import default_weights
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 3)


@pytest.mark.parametrize(
    ("backend", "requested", "expected"),
    [
        ("cpu", None, "f32"),
        ("gpu", None, "bf16"),
        ("cuda", None, "bf16"),
        ("rocm", None, "bf16"),
        ("tpu", None, "bf16"),
        ("gpu", "f32", "f32"),
        ("cpu", "bf16", "bf16"),
        ("tpu", "int8", "int8"),
    ],
)
def test_default_weights_are_bf16_on_accelerators_and_f32_on_cpu(backend, requested, expected):
    assert default_weights(backend, requested) == expected


def test_default_weights_refuse_unknown_names():
    with pytest.raises(ValueError, match="fp8"):
        default_weights("gpu", "fp8")


def test_load_engine_serves_the_backends_default_and_vq_models_their_stored_weights(tmp_path, monkeypatch):
    store = ModelStore(tmp_path)
    store.save("kv", CONFIG, jax.tree_util.tree_map(np.asarray, PARAMS), None, {})
    vq_config = tiny_vq_config()
    vq_params = jax.tree_util.tree_map(np.asarray, init_params(vq_config, 0))
    store.save("vq", vq_config, vq_params, None, {})
    monkeypatch.setenv("HKSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert serving_weights(store, "kv", None) == "bf16"
    assert serving_weights(store, "kv", "f32") == "f32"
    assert serving_weights(store, "vq", None) is None
    engine = load_engine(LoadOptions(model="kv", max_len=64), slots=2)
    assert engine.model.config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(engine.params)} == {jnp.dtype(jnp.bfloat16)}
    assert engine.state.memory.k.dtype == jnp.bfloat16  # the KV memory follows the weights
    assert "decoder/layer_0/mlp/up_proj" in engine.params  # the layer loop's per-layer weights (layer_loop.py)
    assert not any(module.startswith("decoder/layers/") for module in engine.params)
    scan = load_engine(LoadOptions(model="kv", max_len=64, layers="scan"), slots=2)
    assert "decoder/layers/mlp/up_proj" in scan.params and "decoder/layer_0/mlp/up_proj" not in scan.params
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert load_engine(LoadOptions(model="kv", max_len=64), slots=2).model.config.dtype == "float32"


def test_variants_are_made_from_a_bfloat16_master_too():
    bf16_config, bf16 = convert_params(jax.tree_util.tree_map(np.asarray, PARAMS), CONFIG, "bfloat16")
    int8_config, int8 = convert_params(bf16, bf16_config, "int8")
    assert int8_config.dtype == "int8" and int8["decoder/layers/mlp/up_proj"]["w"].dtype == np.int8
    f32_config, f32 = convert_params(bf16, bf16_config, "float32")
    assert f32_config.dtype == "float32"
    up = f32["decoder/layers/mlp/up_proj"]["w"]
    assert up.dtype == np.float32 and np.array_equal(up, bf16["decoder/layers/mlp/up_proj"]["w"].astype(np.float32))


def test_random_llama_1b_has_real_shapes_and_is_made_in_bf16():
    config = random_config("llama3.2-1b", "bfloat16")
    assert 1.2e9 < config.n_params < 1.3e9  # Llama 3.2 1B: 1.24B
    shapes = jax.eval_shape(lambda: random_params(config))
    assert shapes["decoder/embed"]["embeddings"].shape == (128256, 2048)
    assert shapes["decoder/layers/attention/k_proj"]["w"].shape == (16, 2048, 512)
    assert {s.dtype for s in jax.tree_util.tree_leaves(shapes)} == {jnp.dtype(jnp.bfloat16)}
    tiny = random_params(random_config("tiny-llama", "bfloat16"))
    assert set(tiny) == set(shapes) and set(RANDOM_CONFIGS) >= {"llama3.2-1b", "tiny-llama"}


def test_warmup_compiles_what_64_slots_and_long_prompts_need_and_serving_compiles_nothing(compiles):
    engine = Engine(MODEL, PARAMS, EngineOptions(slots=64, max_len=256, prefill_buckets=(8, 32)))
    assert engine.windows == (128, 256) and engine.continuation_windows() == (128, 256)
    compiles.clear()
    engine.warmup()
    rows_programs = len(engine.row_prefill.rows)  # batched prefill: one program per bucket that takes rows
    table = int(engine.kv_pool is not None)  # the paged layout (the default): its block table's update
    assert 0 < len(compiles) <= len(engine.prefill_buckets) + 2 * len(engine.windows) + rows_programs + table
    compiles.clear()
    rng = np.random.default_rng(0)
    firsts = [
        engine.prefill(slot, rng.integers(0, 96, n).tolist(), SamplingParams())
        for slot, n in ((0, 5), (7, 31), (40, 100), (63, 200))
    ]  # one chunk, one full bucket, 4 and 7 chunks
    active = np.zeros(64, bool)
    active[[0, 7, 40, 63]] = True
    tokens = [engine.step(active).read() for _ in range(3)]
    assert [f.read()[0].id for f in firsts] and len(tokens) == 3
    assert compiles == []


def test_prefix_suffixes_of_any_length_and_window_compile_nothing_after_warmup(compiles):
    engine = Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=256, prefill_buckets=(8, 32), prefix_cache="on"))
    engine.warmup()
    compiles.clear()
    prompt = np.random.default_rng(1).integers(0, 96, 250).tolist()
    engine.prefill(0, prompt[:200], SamplingParams()).read()
    for reused, total in ((150, 153), (100, 130), (16, 60), (140, 250)):  # 3..110 tokens, 1-4 chunks
        engine.prefill(1, prompt[:total], SamplingParams(), Reuse(source=0, length=reused)).read()
    assert compiles == []


def test_gpu_command_buffers_are_added_to_xla_flags_unless_named_or_turned_off(monkeypatch):
    from hkserve.cli.main import main
    from hkserve.cli.xla_flags import COMMAND_BUFFERS, apply_gpu_defaults, with_gpu_defaults

    assert with_gpu_defaults("") == COMMAND_BUFFERS
    assert with_gpu_defaults("--xla_force_host_platform_device_count=8").split() == [
        "--xla_force_host_platform_device_count=8",
        COMMAND_BUFFERS,
    ]
    own = "--xla_gpu_enable_command_buffer=FUSION"
    assert with_gpu_defaults(own) == own
    env = {"XLA_FLAGS": "--xla_cpu_foo=1", "HKSERVE_XLA_DEFAULTS": "0"}
    apply_gpu_defaults(env)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1"
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("HKSERVE_XLA_DEFAULTS", raising=False)
    monkeypatch.setenv("HKSERVE_HOME", "/nonexistent-hkserve-home")
    main(["models"])  # every command sets them before it touches a device
    assert os.environ["XLA_FLAGS"] == COMMAND_BUFFERS


def test_this_jaxlib_accepts_the_gpu_options_on_the_cpu():
    """An XLA option the installed jaxlib does not know aborts the process at backend start."""
    from hkserve.cli.xla_flags import COMMAND_BUFFERS

    code = "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    env = {**os.environ, "XLA_FLAGS": COMMAND_BUFFERS, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "3.0"
