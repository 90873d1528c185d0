"""The precision a GGUF file's weights are served at by default, so that a quantized file stays
quantized (issue 36): "int4" for 4-6 bit files and k-quant mixes, "int8" for Q8_0 files, None for
float files (F32/F16/BF16).

The int4 variant (gguf_int4.py) keeps every stack whose tensors are all Q4_0/Q4_1/Q4_K as int4 and
holds the others in 8-bit groups (exact for Q5_0/Q5_1/Q5_K/Q8_0, Q6_K within (max - min) / 510), so
no tensor loses the bits the file gave it. Gemma 3 270M Q4_K_M (27 of its 126 matrices Q4_K, the rest
Q5_0/Q6_K) on the Genesis excerpt of tests/test_weights.py, 256-token windows, against float32 expanded
from the same file (1.8619): this variant 1.8731 (+0.60%); the int8 variant (per channel, from the
float32 master) 1.9075 (+2.45%); int4 forced on every stack (5-6 bit tensors requantized to 4 bits)
3.8612 (+107%)."""

from __future__ import annotations

import gguf

Q = gguf.GGMLQuantizationType
FLOAT = {Q.F32, Q.F16, Q.BF16}
EXACT_INT4 = {Q.Q4_0, Q.Q4_1, Q.Q4_K}  # kept exactly as int4 groups (gguf_int4.py)


def native_weights(reader: gguf.GGUFReader) -> str | None:
    """--weights name of the file's own precision, by the elements of its matrices (the token
    embeddings aside: files keep them at other types): None when floats hold most of them, "int8"
    when all the quantized ones are Q8_0, else "int4"."""
    counts = {"float": 0, "q8": 0, "other": 0}
    for tensor in reader.tensors:
        if len(tensor.shape) < 2 or tensor.name.startswith("token_embd"):
            continue
        kind = "float" if tensor.tensor_type in FLOAT else "q8" if tensor.tensor_type == Q.Q8_0 else "other"
        counts[kind] += int(tensor.n_elements)
    total = sum(counts.values())
    if total == 0 or 2 * counts["float"] >= total:
        return None
    return "int4" if counts["other"] else "int8"
