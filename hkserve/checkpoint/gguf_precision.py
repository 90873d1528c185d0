"""The precision a GGUF file's weights are served at by default, so that a quantized file stays
quantized (issue 36): "int4" when every matrix is in a 4-bit type the int4 variant keeps exactly
(Q4_0/Q4_1/Q4_K, gguf_int4.py), "int8" when other quantized types hold matrices (Q8_0 files, and
k-quant mixes such as Q4_K_M with their Q5_0/Q6_K tensors), None for float files (F32/F16/BF16).

Why mixes go to int8: the int4 variant requantizes a 5-8 bit tensor to 4 bits by min/max per group,
and the files put those types exactly where 4 bits cost most (attn_v, ffn_down; Gemma 3 270M Q4_K_M
has only 27 of its 126 matrices in Q4_K). Against that file's float32 expansion, its int4 variant's
last-position logits correlate 0.95-0.98 and greedy agrees for 7, 0 and 12 of 32 tokens on three
prompts; its int8 variant (per channel, from the float32 master) 0.997-0.999 and 32, 32 and 12 of
32, as close as llama.cpp on the same file (docs/benchmarks.md). `--weights int4` still makes the
4-bit variant on request."""

from __future__ import annotations

import gguf

Q = gguf.GGMLQuantizationType
FLOAT = {Q.F32, Q.F16, Q.BF16}
EXACT_INT4 = {Q.Q4_0, Q.Q4_1, Q.Q4_K}  # kept exactly as int4 groups (gguf_int4.py)


def native_weights(reader: gguf.GGUFReader) -> str | None:
    """--weights name of the file's own precision, by the elements of its matrices (the token
    embeddings aside: files keep them at other types): None when floats hold most of them, "int4"
    when all the quantized ones are of a type int4 keeps exactly, else "int8"."""
    counts = {"float": 0, "int4": 0, "other": 0}
    for tensor in reader.tensors:
        if len(tensor.shape) < 2 or tensor.name.startswith("token_embd"):
            continue
        kind = "float" if tensor.tensor_type in FLOAT else "int4" if tensor.tensor_type in EXACT_INT4 else "other"
        counts[kind] += int(tensor.n_elements)
    total = sum(counts.values())
    if total == 0 or 2 * counts["float"] >= total:
        return None
    return "int8" if counts["other"] else "int4"
