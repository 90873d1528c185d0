"""Import a GGUF file (llama.cpp's tensor names and layouts) onto the decoder.

gguf_config.py reads the metadata; the family's record says how llama.cpp's convert_hf_to_gguf.py
stored the tensors (permuted llama q/k rows, Gemma's norms with their +1, Phi-3's fused q|k|v and
gate|up), which tensor_map.py undoes. Tensors are dequantized one at a time; one the mapping does not
use is an error.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from hkserve.checkpoint.families import gguf_family
from hkserve.checkpoint.gguf_config import LONGROPE_TENSORS, config_from_gguf
from hkserve.checkpoint.gguf_reader import dequantize, field, open_gguf
from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.checkpoint.tensor_map import neutral_tensors
from hkserve.model.config import ModelConfig


class _Tensors:
    """Reader tensors by name, dequantized on demand; remembers which were never asked for."""

    def __init__(self, reader: gguf.GGUFReader, decode=dequantize):
        self._by_name = {t.name: t for t in reader.tensors}
        self.decode = decode  # reader tensor → array (gguf_int4.py: linear weights as int4 groups)
        self.unread = set(self._by_name) - {"rope_freqs.weight", *LONGROPE_TENSORS}  # read into the config

    def get(self, name: str) -> np.ndarray:
        if name not in self._by_name:
            raise ImportFormatError(f"GGUF lacks tensor {name}")
        self.unread.discard(name)
        return self.decode(self._by_name[name])


def load_gguf(
    path: str | Path, dtype: str = "float32", progress: bool = False, context_length: int = 0
) -> tuple[ModelConfig, dict, gguf.GGUFReader]:
    """→ (ModelConfig, Haiku params as numpy, the open reader for the tokenizer); `context_length` as
    config_from_gguf takes it."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype, context_length)
    arch = field(reader, "general.architecture")
    t = _Tensors(reader)
    layers = tqdm(range(config.n_layers), desc="dequantize", unit="layer", disable=not progress)
    params = assemble_params(config, neutral_tensors(t, gguf_family(arch).gguf, config, layers))
    if t.unread:
        raise ImportFormatError(f"{arch}: tensors this importer does not use: {', '.join(sorted(t.unread)[:5])}")
    return config, params, reader
