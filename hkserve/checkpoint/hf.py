"""Import a Hugging Face checkpoint directory (config.json + safetensors, one file or sharded) of any
family with HF names in families.py (hf_config.py reads the config, tensor_map.py maps the tensors).

Tensors are read layer by layer from their byte ranges (safetensors_dir.py), gpt-oss's MXFP4 experts
expanded exactly (mxfp4.py); a tensor the checkpoint holds but the mapping does not use is an error, so an
unsupported weight (an o_proj bias, say) is never silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

from hkserve.checkpoint.hf_config import config_from_hf, family_of
from hkserve.checkpoint.mxfp4 import Mxfp4Tensors
from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.checkpoint.safetensors_dir import SafetensorsDir
from hkserve.checkpoint.tensor_map import neutral_tensors
from hkserve.model.config import ModelConfig

# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf(directory: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Read config and weights of an HF directory → (ModelConfig, Haiku params as numpy)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ImportFormatError(f"{directory} has no config.json")
    raw = json.loads(cfg_path.read_text())
    config = config_from_hf(raw, dtype)
    family = family_of(raw)
    t = SafetensorsDir(directory)
    source = Mxfp4Tensors(t) if raw.get("quantization_config") else t  # config_from_hf checked it is MXFP4
    params = assemble_params(config, neutral_tensors(source, family.hf, config, range(config.n_layers)))
    if config.tie_embeddings:
        t.unread.discard(family.hf.lm_head)  # a tied model's saved copy of the embeddings: transformers ties it too
    left = sorted(n for n in t.unread if not n.endswith(_IGNORED_SUFFIXES))
    if left:
        raise ImportFormatError(f"{family.name}: tensors this importer does not use: {', '.join(left[:5])}")
    return config, params
