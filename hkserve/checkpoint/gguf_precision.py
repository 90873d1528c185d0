"""The precision a GGUF file's weights were quantized to, so that a quantized file is stored and served
at it (issue 36): "int4" for 4-6 bit files (Q4_0/Q4_1/Q4_K kept exactly as int4 groups, Q5/Q6 tensors
requantized, kernels/README.md), "int8" for Q8_0 files, None for float files (F32/F16/BF16)."""

from __future__ import annotations

import gguf

Q = gguf.GGMLQuantizationType
FLOAT = {Q.F32, Q.F16, Q.BF16}
EIGHT_BIT = {Q.Q8_0}


def native_weights(reader: gguf.GGUFReader) -> str | None:
    """--weights name of the file's own precision, by the elements of its matrices (the token
    embeddings aside: files keep them at other types): None when floats hold most of them, "int8"
    when Q8_0 does, else "int4" (k-quant mixes such as Q4_K_M: Q4_K with some Q6_K)."""
    counts = {"float": 0, "int8": 0, "int4": 0}
    for tensor in reader.tensors:
        if len(tensor.shape) < 2 or tensor.name.startswith("token_embd"):
            continue
        kind = "float" if tensor.tensor_type in FLOAT else "int8" if tensor.tensor_type in EIGHT_BIT else "int4"
        counts[kind] += int(tensor.n_elements)
    total = sum(counts.values())
    if total == 0 or 2 * counts["float"] >= total:
        return None
    return "int8" if 2 * counts["int8"] >= total else "int4"
