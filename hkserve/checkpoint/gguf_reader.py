"""Open a GGUF file and read its metadata and tensors (dequantized by the `gguf` package)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from hkserve.checkpoint.params import ImportFormatError


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ImportFormatError(f"no such GGUF file: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct/IndexError, ... on damaged files
        raise ImportFormatError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def dequantize(tensor) -> np.ndarray:
    """A reader tensor as float32 in [out, in] order (GGUF lists dims innermost first)."""
    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ImportFormatError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {e}") from None
    return np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
