"""The decoder with KV memory: cached decoding must equal recomputing the whole sequence."""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config, tiny_vq_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.config import with_kv_dtype
from hkserve.model.memory import cache_dtype, init_memory, insert_slot

TOL = 1e-5
BUCKETS = (8, 16, 32)


@functools.cache
def _jitted_forward(model):
    return jax.jit(model.forward)


def full_logits(model, params, seq, pad_to: int = 64) -> np.ndarray:
    """Reference: the whole sequence in one causal forward on an empty memory. [T, V]

    Padded to a fixed length so every call reuses one compile; causal attention keeps the padding
    from touching the real positions."""
    tokens = np.zeros((1, pad_to), np.int32)
    tokens[0, : len(seq)] = seq
    memory = init_memory(model.config, 1, pad_to)
    logits, _ = _jitted_forward(model)(params, tokens, memory, jnp.asarray([len(seq)], jnp.int32))
    return np.asarray(logits[0, : len(seq)])


INIT_CONFIGS = {  # the digest of its eager init(PRNGKey(7)) (jax 0.10.2)
    "kv": (tiny_config(vocab_size=96, sliding_window=24, sliding_layers=(True, False)), "27f7a0365cf65f36"),
    "moe": (tiny_config(n_experts=4), "0c0f370605a281d2"),
    "vq": (tiny_vq_config(), "b03f2bf098de4417"),
}


def digest(params) -> str:
    """A hash of every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(f"{jax.tree_util.keystr(path)} {leaf.dtype} {leaf.shape}".encode())
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", INIT_CONFIGS)
def test_init_params_are_the_eager_inits_bit_for_bit(name):
    """The tests' random weights come from one jitted init (helpers.init_params); some tests pick prompts
    and seeds on these weights, so they must be the eager init's, pinned here (the eager init takes
    seconds a call: it is compared live by the slow test below)."""
    config, eager = INIT_CONFIGS[name]
    assert digest(init_params(config, 7)) == eager


@pytest.mark.slow
@pytest.mark.parametrize("name", INIT_CONFIGS)
def test_the_pinned_digests_are_the_eager_inits(name):
    config, eager = INIT_CONFIGS[name]
    assert digest(build_model(config).init(jax.random.PRNGKey(7))) == eager


def bucket_for(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


@pytest.mark.parametrize("experts", [0, 4])
def test_cached_decode_equals_full_recompute_with_slots_at_different_positions(experts):
    config = tiny_config(n_experts=experts)
    model = build_model(config)
    params = init_params(config, 1)
    rng = np.random.default_rng(0)
    prompt_lens = [7, 8, 9, 16, 17]  # both sides of the 8 and 16 bucket boundaries
    decode_steps = 6
    seqs = [rng.integers(0, config.vocab_size, n + decode_steps).tolist() for n in prompt_lens]
    memory = init_memory(config, len(seqs), 64)
    forward = jax.jit(model.forward, static_argnums=(5, 6))

    for slot, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        tokens = np.zeros((1, bucket_for(n)), np.int32)
        tokens[0, :n] = seq[:n]
        logits, memory = forward(
            params, tokens, memory, np.asarray([n], np.int32), np.asarray([slot], np.int32), 0, True
        )
        np.testing.assert_allclose(logits[0], full_logits(model, params, seq[:n])[n - 1], atol=TOL)
    np.testing.assert_array_equal(memory.step, prompt_lens)

    for step in range(decode_steps):
        tokens = np.asarray([[seq[n + step]] for seq, n in zip(seqs, prompt_lens)], np.int32)
        logits, memory = forward(params, tokens, memory, np.ones(len(seqs), np.int32), None, 32, False)
        for slot, (seq, n) in enumerate(zip(seqs, prompt_lens)):
            reference = full_logits(model, params, seq[: n + step + 1])[-1]
            np.testing.assert_allclose(logits[slot, 0], reference, atol=TOL, err_msg=f"slot {slot} step {step}")


def test_idle_slots_are_left_untouched_by_a_decode_step():
    config = tiny_config()
    model = build_model(config)
    params = init_params(config, 2)
    memory = init_memory(config, 3, 16)
    tokens = np.asarray([[5], [6], [7]], np.int32)
    _, after = model.forward(params, tokens, memory, np.asarray([1, 0, 1], np.int32))
    np.testing.assert_array_equal(after.step, [1, 0, 1])
    assert not np.asarray(after.k[:, 1]).any()
    assert np.asarray(after.k[:, 0, 0]).any() and not np.asarray(after.k[:, 0, 1]).any()


def test_auto_keeps_float32_weights_memory_float32_and_narrower_weights_bf16():
    """--kv-dtype auto: a float32 memory for float32 weights only; bf16, int8 and int4 weights keep a
    bfloat16 one (half the bytes, as llama.cpp's f16 default), unless f32 is asked for."""
    config = tiny_config()
    assert cache_dtype(config) == jnp.float32
    for dtype in ("bfloat16", "int8", "int4"):
        narrow = config.replace(dtype=dtype)
        assert cache_dtype(narrow) == jnp.bfloat16, dtype
        assert cache_dtype(with_kv_dtype(narrow, "f32")) == jnp.float32, dtype


def test_a_bf16_memory_holds_each_key_rounded_once_and_is_read_as_its_float32_copy():
    """--kv-dtype bf16 on XLA's path: prefill writes the float32 memory's keys and values rounded to bf16,
    and decode steps give the bits of a float32 memory holding those rounded values (the read upcasts)."""
    config = tiny_config()
    half = with_kv_dtype(config, "bf16")
    assert cache_dtype(half) == jnp.bfloat16 and cache_dtype(config) == jnp.float32
    model = build_model(config)
    params = init_params(config, 4)
    forward = jax.jit(model.forward, static_argnames=("attend_len",))
    prompt, lengths = np.asarray([list(range(3, 12)), list(range(20, 29))], np.int32), np.asarray([9, 6], np.int32)
    _, wide = forward(params, prompt, init_memory(config, 2, 16), lengths)
    _, narrow = forward(params, prompt, init_memory(half, 2, 16), lengths)
    assert narrow.k.dtype == jnp.bfloat16 == narrow.v.dtype
    np.testing.assert_array_equal(narrow.k, wide.k.astype(jnp.bfloat16))
    np.testing.assert_array_equal(narrow.v, wide.v.astype(jnp.bfloat16))
    assert np.abs(np.asarray(wide.k) - np.asarray(narrow.k.astype(jnp.float32))).max() > 1e-3  # there to see

    def widened(memory):  # a float32 memory of the bf16 memory's values
        return memory._replace(k=memory.k.astype(jnp.float32), v=memory.v.astype(jnp.float32))

    for step in range(3):
        token = np.full((2, 1), 40 + step, np.int32)
        want, _ = forward(params, token, widened(narrow), np.ones(2, np.int32), attend_len=16)
        got, narrow = forward(params, token, narrow, np.ones(2, np.int32), attend_len=16)
        np.testing.assert_array_equal(got, want)


def test_a_kv_dtype_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="unsupported kv_dtype"):
        tiny_config(kv_dtype="float16")
    with pytest.raises(ValueError, match="Transformer-VQ memory keeps its own"):
        with_kv_dtype(tiny_vq_config(), "bf16")
    with pytest.raises(ValueError, match="--kv-dtype must be one of auto | f32 | bf16"):
        with_kv_dtype(tiny_config(), "fp8")
    assert with_kv_dtype(tiny_vq_config(), "auto") == tiny_vq_config()


def test_insert_slot_places_a_prefilled_memory_into_the_batch():
    config = tiny_config()
    model = build_model(config)
    params = init_params(config, 3)
    seq = list(range(3, 13))
    single = init_memory(config, 1, 16)
    _, single = model.forward(params, jnp.asarray([seq[:9]], jnp.int32), single, jnp.asarray([9], jnp.int32))
    batch = insert_slot(init_memory(config, 4, 32), single, 2)
    np.testing.assert_array_equal(batch.step, [0, 0, 9, 0])
    tokens = np.zeros((4, 1), np.int32)
    tokens[2, 0] = seq[9]
    logits, _ = model.forward(params, tokens, batch, np.asarray([0, 0, 1, 0], np.int32))
    np.testing.assert_allclose(logits[2, 0], full_logits(model, params, seq)[-1], atol=TOL)


def test_chunked_prefill_over_three_buckets_equals_full_recompute():
    config = tiny_config()
    model = build_model(config)
    params = init_params(config, 4)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()  # 16 + 16 + 8
    runner = InferenceRunner(Engine(model, params, EngineOptions(slots=2, max_len=128, prefill_buckets=(8, 16)))).start(
        warmup=False
    )
    try:
        got = [t.id for t in runner.generate(Request(prompt, 8))]
    finally:
        runner.stop()
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(np.argmax(full_logits(model, params, seq)[-1])))
    assert got == seq[len(prompt) :]


def test_compiled_size_does_not_grow_with_depth():
    """Layers are scanned: 16 layers lower to about the same program as 2."""

    def program_size(layers: int) -> int:
        config = tiny_config(n_layers=layers)
        model = build_model(config)
        params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
        memory = jax.eval_shape(lambda: init_memory(config, 2, 32))
        tokens = jax.ShapeDtypeStruct((2, 1), jnp.int32)
        lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
        return len(jax.jit(model.forward).lower(params, tokens, memory, lengths).as_text())

    assert program_size(16) < 1.1 * program_size(2)
