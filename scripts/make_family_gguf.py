"""Remake tests/fixtures/gguf/*: llama.cpp's own converter (`convert_hf_to_gguf.py --outtype f32`) run on
the HF fixtures of tests/fixtures/hf that llama.cpp has an architecture for (Qwen2-MoE, Qwen3-MoE,
Granite, OLMo 2, SmolLM3; linear and yarn RoPE scaling as llama, longrope as phi3 with its factor tensors).
The weights are the HF fixture's, so a correct GGUF import reproduces that fixture's reference.json, except
where the converter drops what transformers reads (SmolLM3's no_rope_layers: llama.cpp fixes every 4th layer,
so tiny-smollm3's 2nd-layer pattern is lost; VARIANTS adds a 4-layer one where both agree).
scripts/record_llama_logits.py then records llama.cpp's own logits beside each file.

The converter is the one vendored by llama-cpp-python 0.3.36 (llama.cpp 0c1e5709, as ../shared/fixtures/gguf):

    .venv/bin/pip download --no-deps --no-binary :all: -d /tmp llama-cpp-python==0.3.36
    tar xzf /tmp/llama_cpp_python-0.3.36.tar.gz -C /tmp
    .venv/bin/pip install 'transformers>=4.45' torch sentencepiece
    .venv/bin/python scripts/make_family_gguf.py /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp [NAME...]

(NAME: a directory of tests/fixtures/hf or a VARIANTS name; by default every one tests/fixtures/gguf has.)

The tiny checkpoints have no tokenizer: one is trained here (SentencePiece BPE, 128 pieces, unk 0, <s> 1,
</s> 2) and the converter is told to read it as SentencePiece (its Qwen-MoE path expects a GPT-2 BPE
tokenizer.json of a known pre-tokenizer, OLMo 2's too); only the tokenizer metadata depends on that, never
a weight.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import sentencepiece

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "how vexingly quick daft zebras jump",
    "sphinx of black quartz judge my vow",
]


# GGUF-only variants of an HF fixture: its config changed, fresh random weights by transformers (seeded; norms
# 1 + 0.1 N(0, 1) as in make_family_fixtures.py), and transformers' logits for the fixture's input_ids saved as
# reference.json beside the GGUF. tiny-smollm3-4: 4 layers, so that llama.cpp's fixed no-RoPE layer (the 4th)
# exists, and no_rope_layers says the same.
VARIANTS = {
    "tiny-smollm3-4": (
        "tiny-smollm3",
        {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0], "no_rope_layer_interval": 4},
    )
}


def build_variant(name: str, model_dir: Path) -> None:
    import torch  # only variants need transformers
    import transformers

    base, changes = VARIANTS[name]
    config = transformers.AutoConfig.from_pretrained(ROOT / "hf" / base)
    for key, value in {**changes, "layer_types": ["full_attention"] * changes["num_hidden_layers"]}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    ids = json.loads((ROOT / "hf" / base / "reference.json").read_text())["input_ids"]
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
        logits = model(torch.tensor(ids)).logits
    model.save_pretrained(model_dir)
    reference = {
        "note": f"{base} with {json.dumps(changes)}, new random weights",
        "reference": f"transformers {transformers.__version__} {type(model).__name__}, float32",
        "input_ids": ids,
        "logits": logits.tolist(),
    }
    (ROOT / "gguf" / name / "reference.json").write_text(json.dumps(reference) + "\n")


# SentencePiece BPE of the fixtures' vocabulary size, llama.cpp's specials (pad: none)
SPM = {"vocab_size": 128, "model_type": "bpe", "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}


def train_tokenizer(path: Path) -> None:
    model = io.BytesIO()
    trainer = sentencepiece.SentencePieceTrainer
    trainer.train(sentence_iterator=iter(TEXT * 50), model_writer=model, hard_vocab_limit=False, minloglevel=2, **SPM)
    path.write_bytes(model.getvalue())


def convert(llama_cpp: Path, name: str) -> None:
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf  # llama.cpp's, found through its directory only
    from conversion import get_model_class

    source = ROOT / "hf" / VARIANTS.get(name, (name,))[0]
    architecture = json.loads((source / "config.json").read_text())["architectures"][0]
    get_model_class(architecture).set_vocab = lambda self: self._set_vocab_sentencepiece()
    out = ROOT / "gguf" / name
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / name  # the converter names the model after its directory
        model.mkdir()
        if name in VARIANTS:
            build_variant(name, model)
        else:
            for file in ("config.json", "model.safetensors"):
                shutil.copy(source / file, model / file)
        train_tokenizer(model / "tokenizer.model")
        sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32", "--outfile", str(out / f"{name}.f32.gguf")]
        convert_hf_to_gguf.main()


def main() -> None:
    llama_cpp = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.name for p in (ROOT / "gguf").iterdir() if p.is_dir())
    for name in names:
        convert(llama_cpp, name)


if __name__ == "__main__":
    main()
