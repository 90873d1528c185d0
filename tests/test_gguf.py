"""GGUF import: a llama GGUF written the way llama.cpp's converter writes one (permuted q/k rows,
quantized matrices, SentencePiece vocabulary) must come back as the original model."""

from __future__ import annotations

import io
import json
import os

import gguf
import jax
import numpy as np
import pytest
import sentencepiece as spm
from helpers import hkserve, require_fixtures
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from hkserve.checkpoint.gguf_import import load_gguf
from hkserve.checkpoint.gguf_reader import open_gguf
from hkserve.checkpoint.store import ModelStore
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory

TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "The quick brown fox jumps over the lazy dog, again and again, 1234 times.",
    "Serving language models quickly needs batching, caching and careful memory layout.",
] * 20


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's row permutation for attn_q / attn_k."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_sentencepiece(vocab_size: int) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_llama_gguf(
    path,
    hf_dir,
    sp: spm.SentencePieceProcessor,
    quantize: bool = True,
    qtype=gguf.GGMLQuantizationType.Q8_0,
    types: dict | None = None,
):
    """The HF checkpoint in `hf_dir` as llama.cpp would convert it, with `sp`'s vocabulary; with
    `quantize`, its matrices as `qtype`, or as `types[tensor name]` for the names it holds (a mix such as
    Q4_K_M's)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    proto = sp_pb2.ModelProto.FromString(sp.serialized_model_proto())
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    pieces += [(f"<unused{i}>", 0.0, 5) for i in range(cfg["vocab_size"] - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list([p[0] for p in pieces])
    w.add_token_scores([p[1] for p in pieces])
    w.add_token_types([p[2] for p in pieces])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")

    def add(name, array):
        array = np.ascontiguousarray(array, np.float32)
        if quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
            kind = (types or {}).get(name, qtype)
            q = gguf.quants.quantize(array, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, array)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if not cfg["tie_word_embeddings"]:
        add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", t[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", llama_cpp_permute(t[p + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", llama_cpp_permute(t[p + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{i}.attn_v.weight", t[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", t[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            add(f"blk.{i}.ffn_{ours}.weight", t[p + f"mlp.{theirs}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece(200)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, sp):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(path, require_fixtures() / "hf" / "tiny-llama-tied", sp, quantize=False)
    return path


def test_unpermuted_gguf_reproduces_transformers_logits(gguf_file):
    reference = json.loads((require_fixtures() / "hf" / "tiny-llama-tied" / "reference.json").read_text())
    config, params, _ = load_gguf(gguf_file)
    assert config.tie_embeddings and (config.n_heads, config.n_kv_heads) == (4, 2)
    assert_logits_match(config, params, reference)


def test_untied_gguf_with_rope_freq_base_5e5_reproduces_transformers_logits(tmp_path, sp):
    """A non-default RoPE theta (llama.rope.freq_base = 500000) and a separate output matrix."""
    hf_dir = require_fixtures() / "hf" / "tiny-llama-untied"
    path = tmp_path / "untied.gguf"
    write_llama_gguf(path, hf_dir, sp, quantize=False)
    config, params, _ = load_gguf(path)
    assert config.rope_theta == 500000.0 and not config.tie_embeddings
    assert_logits_match(config, params, json.loads((hf_dir / "reference.json").read_text()))


def assert_logits_match(config, params, reference: dict) -> None:
    model = build_model(config)
    ids = np.asarray(reference["input_ids"], np.int32)
    logits, _ = jax.jit(model.forward)(
        params, ids, init_memory(config, 2, ids.shape[1]), np.full(2, ids.shape[1], np.int32)
    )
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference["logits"]), atol=1e-4, rtol=0)


def test_quantized_tensors_are_dequantized_like_gguf(tmp_path, sp):
    path = tmp_path / "q8.gguf"
    hf_dir = require_fixtures() / "hf" / "tiny-llama-tied"
    write_llama_gguf(path, hf_dir, sp, quantize=True)
    _, params, reader = load_gguf(path)
    from safetensors.numpy import load_file

    up = load_file(str(hf_dir / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    assert next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight").tensor_type.name == "Q8_0"
    np.testing.assert_array_equal(params["decoder/layers/mlp/up_proj"]["w"][1], expected.T)
    assert not np.array_equal(expected, up)  # quantization really happened


def test_sentencepiece_tokenizer_rebuilt_from_gguf_metadata(gguf_file, sp, tmp_path):
    tokenizer = Tokenizer.from_gguf(open_gguf(gguf_file))
    assert tokenizer.kind == "sentencepiece" and tokenizer.add_bos
    for text in ["In the beginning God created", "a fox jumps 1234 times", "unseen wörds ünïcode"]:
        assert tokenizer.encode(text, add_bos=False) == sp.encode(text)
        assert tokenizer.encode(text)[0] == sp.bos_id()
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    # A model's padded vocabulary rows past the tokenizer's (sampling can reach them) have no text.
    ids, past = sp.encode("a fox"), tokenizer.vocab_size
    assert tokenizer.decode([*ids, past, past + 7]) == tokenizer.decode(ids) == sp.decode(ids)
    assert tokenizer.decode([past, *ids], skip_special=False) == sp.decode(ids)
    assert tokenizer.token_text(past) == "" and tokenizer.token_bytes(past) == b""
    tokenizer.save(tmp_path / "tok")
    again = Tokenizer.load(tmp_path / "tok")
    assert again.encode("the quick brown fox") == tokenizer.encode("the quick brown fox")
    assert (again.bos_id, again.eos_id, again.chat_template) == (
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.chat_template,
    )


def _store_snapshot(home) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), home) for d, _, fs in os.walk(home) for f in fs)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "architecture"])
def test_bad_gguf_gives_one_line_error_and_leaves_store_unchanged(tmp_path, gguf_file, damage):
    home = tmp_path / "home"
    hkserve("convert", str(gguf_file), "--name", "good", "--quiet", home=home)
    before = _store_snapshot(home)
    bad = tmp_path / "bad.gguf"
    if damage == "truncated":
        bad.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    elif damage == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        w = gguf.GGUFWriter(str(bad), "falcon")
        w.add_block_count(1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    result = hkserve("convert", str(bad), "--name", "bad", "--quiet", home=home, check=False)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("hkserve convert: error:")]
    assert len(lines) == 1, result.stderr
    if damage == "architecture":
        assert "'falcon'" in lines[0]
    assert _store_snapshot(home) == before
    assert [m.name for m in ModelStore(home).list()] == ["good"]
