"""The tensors of a Hugging Face checkpoint directory, read one at a time on demand.

One `model.safetensors`, or the shards `model.safetensors.index.json` names
(`model-0000N-of-0000M.safetensors`). The safetensors header is parsed here so that bfloat16 (which
numpy lacks; JAX's ml_dtypes type is used) reads like float32 and float16, and each tensor is read from its own
byte range, so a caller that goes layer by layer holds one layer's tensors at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hkserve.checkpoint.params import ImportFormatError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}
_RAW_DTYPES = {"U8": np.uint8}
INDEX = "model.safetensors.index.json"


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {"dtype", "shape", "data_offsets"}})."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


class SafetensorsDir:
    def __init__(self, directory: Path):
        index = directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ImportFormatError(f"{INDEX} names shards that are not there: {', '.join(missing)}")
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ImportFormatError(f"no *.safetensors in {directory}")
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            start, header = _header(path)
            for name, entry in header.items():
                self._where[name] = (path, start, entry)
        self.unread = set(self._where)  # tensors no importer asked for yet

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32."""
        return self._read(name, _DTYPES).astype(np.float32, copy=False)

    def raw(self, name: str) -> np.ndarray:
        """An integer tensor as stored (uint8: mxfp4.py's blocks and scales)."""
        return self._read(name, _RAW_DTYPES)

    def _read(self, name: str, dtypes: dict) -> np.ndarray:
        if name not in self._where:
            raise ImportFormatError(f"missing tensor {name}")
        path, start, entry = self._where[name]
        dtype = dtypes.get(entry["dtype"])
        if dtype is None:
            raise ImportFormatError(f"tensor {name} has unsupported dtype {entry['dtype']} ({', '.join(dtypes)})")
        begin, end = entry["data_offsets"]
        count = (end - begin) // np.dtype(dtype).itemsize
        data = np.fromfile(path, dtype=dtype, count=count, offset=start + begin)
        self.unread.discard(name)
        return data.reshape(entry["shape"])
