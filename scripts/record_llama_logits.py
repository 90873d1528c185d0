"""Record llama.cpp's own logits for each GGUF fixture of tests/fixtures/gguf (made by
scripts/make_family_gguf.py) into reference_llamacpp.json beside it: the independent reference the GGUF
import is compared to, as ../shared/fixtures/gguf's files are for the older families.

llama-cpp-python 0.3.36 (the llama.cpp whose converter wrote the files), `logits_all`, no BOS, each row of
the HF fixture's `input_ids` evaluated from an empty cache, float32 KV cache (so what is left is llama.cpp's
arithmetic, not f16 rounding of the cache). llama.cpp pads its context to 256, past tiny-rope-longrope's original
16: it takes the long factors there (transformers' reference.json, 13 tokens, the short ones):

    .venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python scripts/record_llama_logits.py [NAME...]

The tests read the committed files and never need llama.cpp.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
F32 = 0  # GGML_TYPE_F32, for the KV cache


def llama_logits(path: Path, rows: list[list[int]]) -> np.ndarray:
    """[B, T, V] logits llama.cpp computes for each row of token ids."""
    width = max(len(row) for row in rows)
    llm = llama_cpp.Llama(
        str(path), n_ctx=max(32, width), logits_all=True, n_threads=2, verbose=False, type_k=F32, type_v=F32
    )
    out = []
    for row in rows:
        llm.reset()
        llm.eval(row)
        out.append(np.array(llm.scores[: len(row)], np.float32))
    return np.stack(out)


def record(name: str) -> None:
    path = FIXTURES / "gguf" / name / f"{name}.f32.gguf"
    variant = path.parent / "reference.json"  # make_family_gguf.py's VARIANTS keep theirs beside the GGUF
    hf = json.loads((variant if variant.exists() else FIXTURES / "hf" / name / "reference.json").read_text())
    logits = llama_logits(path, hf["input_ids"])
    diff = float(np.abs(logits - np.asarray(hf["logits"], np.float32)).max())
    reference = {
        "input_ids": hf["input_ids"],
        "logits": np.round(logits, 6).tolist(),
        "llama_cpp": f"llama-cpp-python {llama_cpp.__version__}, logits_all, no BOS, f32 KV cache",
        "converter": "convert_hf_to_gguf.py from the same sdist, --outtype f32 (scripts/make_family_gguf.py)",
        "max_abs_diff_vs_transformers": diff,
    }
    (path.parent / "reference_llamacpp.json").write_text(json.dumps(reference) + "\n")
    print(f"{name}: llama.cpp vs transformers max |diff| {diff:.2e}")


def main() -> None:
    names = sys.argv[1:] or sorted(p.name for p in (FIXTURES / "gguf").iterdir() if p.is_dir())
    for name in names:
        record(name)


if __name__ == "__main__":
    main()
