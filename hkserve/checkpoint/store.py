"""The model store: converted models under HKSERVE_HOME (default ~/.cache/hkserve).

$HKSERVE_HOME/models/<name>/config.json      ModelConfig (its dtype: that of params/)
                           /params/          orbax checkpoint: the float master, or for a quantized
                                             GGUF only the int8/int4 variant it serves (no master)
                           /params-<dtype>/  other weight variants, made on request
                           /params*.packed.json  int8/int4 params stored in the CPU kernels' packed
                                             layout (model/packing.py): its layout version
                           /tokenizer/       tokenizer.json | tokenizer.model + tokenizer_config.json
                           /source.json      where it came from
$HKSERVE_HOME/tmp/                           work dirs; a model appears by one rename when complete
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from hkserve.checkpoint.expand import QUANTIZED, expand_params
from hkserve.checkpoint.orbax_io import restore_params, save_params
from hkserve.checkpoint.packed_store import kernel_packing, pack_for_store, stored_layout
from hkserve.checkpoint.quantize import convert_params
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.model.build import param_shapes
from hkserve.model.config import WEIGHTS, ModelConfig, default_weights
from hkserve.model.packing import STORED_LAYOUT, unpack_layers

DEFAULT_MODEL = "smollm2-135m-instruct"
log = logging.getLogger("hkserve.store")


def store_root() -> Path:
    return Path(os.environ.get("HKSERVE_HOME", "~/.cache/hkserve")).expanduser().absolute()


class DamagedModel(ValueError):
    """A model directory whose files cannot be read (a broken config, truncated params...)."""

    def __init__(self, name: str, reason: str):
        first_line = (reason.strip().splitlines() or ["unreadable"])[0][:300]
        super().__init__(f"model {name} is damaged: {first_line}")
        self.name = name


class ModelInfo(NamedTuple):
    name: str
    path: Path
    config: ModelConfig
    source: dict
    has_tokenizer: bool


class ModelStore:
    def __init__(self, root: Path | None = None):
        self.root = Path(root).absolute() if root else store_root()
        self.models_dir = self.root / "models"

    def path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid model name {name!r}")
        return self.models_dir / name

    def exists(self, name: str) -> bool:
        return (self.path(name) / "config.json").is_file()

    def info(self, name: str) -> ModelInfo:
        path = self.path(name)
        if not self.exists(name):
            known = ", ".join(m.name for m in self.list()) or "none"
            raise FileNotFoundError(
                f"model {name!r} is not in the store {self.models_dir} (have: {known}); "
                f"run `hkserve pull` or `hkserve convert`"
            )
        try:
            source = json.loads((path / "source.json").read_text()) if (path / "source.json").is_file() else {}
            config = ModelConfig.from_json((path / "config.json").read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:  # bad JSON, unknown or mistyped fields
            raise DamagedModel(name, f"{path / 'config.json'}: {type(e).__name__}: {e}") from e
        return ModelInfo(name, path, config, source, (path / "tokenizer" / "tokenizer_config.json").is_file())

    def list(self) -> list[ModelInfo]:
        """The readable models (see `scan` for the damaged ones too)."""
        return self.scan()[0]

    def scan(self) -> tuple[list[ModelInfo], list[DamagedModel]]:
        """(readable models, damaged ones): one broken model never hides the others."""
        models, damaged = [], []
        if self.models_dir.is_dir():
            for p in sorted(self.models_dir.iterdir()):
                if (p / "config.json").is_file():
                    try:
                        models.append(self.info(p.name))
                    except DamagedModel as e:
                        damaged.append(e)
        return models, damaged

    def tokenizer(self, name: str) -> Tokenizer:
        info = self.info(name)
        if not info.has_tokenizer:
            raise ValueError(f"model {name!r} has no tokenizer (it was imported from weights only)")
        return Tokenizer.load(info.path / "tokenizer")

    def config(self, name: str, weights: str | None = None) -> ModelConfig:
        """The model's config, for a weight variant (f32 | bf16 | int8 | int4) when given."""
        config = self.info(name).config
        if weights is None or WEIGHTS[weights] == config.dtype:
            return config
        if config.memory == "vq":
            raise ValueError(
                f"model {name!r} is a Transformer-VQ model: it serves its stored {config.dtype} "
                f"weights only (weight variants are for KV models)"
            )
        return config.replace(dtype=WEIGHTS[weights])

    def params(self, name: str, shardings=None, weights: str | None = None, packing=None) -> dict:
        """Params restored onto `shardings`; a weight variant is made from the stored params (and kept
        next to them as params-<dtype>) the first time it is asked for: from the float master, or
        from the quantized weights a model without one stores, expanded (checkpoint/expand.py).
        int8/int4 params stored packed come back packed where `packing` (the serving model's
        model/packing.py stored_packing: it reads them so) is given, else unpacked."""
        info, config = self.info(name), self.config(name, weights)
        return self._restore(info, self.variant_path(name, weights), config, shardings, packing)

    def variant_path(self, name: str, weights: str | None = None) -> Path:
        """The directory of the params of variant `weights` (None: those stored), made if missing."""
        info, config = self.info(name), self.config(name, weights)
        if config.dtype == info.config.dtype:
            return info.path / "params"
        path = info.path / f"params-{config.dtype}"
        if not path.exists():
            self._make_variant(info, config.dtype, path)
        return path

    @staticmethod
    def _restore(info: ModelInfo, path: Path, config: ModelConfig, shardings, packing=None) -> dict:
        """Restore, turning any failure to read the stored files (missing, truncated, corrupt: orbax and
        TensorStore raise many kinds) into one line naming the model."""
        if not path.is_dir():
            raise DamagedModel(info.name, f"{path} is missing")
        layout = stored_layout(path)
        if layout not in (None, STORED_LAYOUT):
            raise DamagedModel(
                info.name,
                f"{path} is packed in layout {layout}, this hkserve reads {STORED_LAYOUT}: convert the model "
                f"again (`hkserve convert {info.source.get('path', 'FILE')} --name {info.name} --overwrite`)",
            )
        unpack = layout is not None and packing is None  # packed on disk, read plain (the XLA path)
        shapes = None if layout is None else jax.eval_shape(packing or kernel_packing(config), param_shapes(config))
        try:  # the mesh's shardings fit the plain shapes: packed ones to unpack are read onto one device
            params = restore_params(path, config, None if unpack else shardings, shapes)
        except Exception as e:
            raise DamagedModel(info.name, f"cannot read {path}: {type(e).__name__}: {e}") from e
        if not unpack:  # plain, or packed for a model that reads them packed
            return params
        plain = jax.jit(functools.partial(unpack_layers, plain=param_shapes(config)))(params)
        return plain if shardings is None else jax.device_put(plain, shardings)

    def _make_variant(self, info: ModelInfo, dtype: str, path: Path) -> None:
        config = info.config
        master = jax.tree_util.tree_map(np.asarray, self._restore(info, info.path / "params", config, None))
        if config.dtype in QUANTIZED:
            log.warning(
                "%s stores %s weights only: its %s variant is expanded from them, equal to the source file's "
                "dequantization only where %s kept its blocks exactly; `hkserve convert %s --name %s --weights f32 "
                "--overwrite` stores the file's exact float32",
                info.name,
                config.dtype,
                dtype,
                config.dtype,
                info.source.get("path", "FILE"),
                info.name,
            )
            config, master = expand_params(master, config)
        variant_config, variant = convert_params(master, config, dtype)
        self._write_variant(info, variant_config, path, variant)

    def set_cpu_default(self, name: str, weights: str) -> None:
        """Record `weights` (int8 | int4) as the variant `serve` runs on a CPU without --weights (source.json
        "weights", as convert records a quantized GGUF's), written by one rename."""
        info = self.info(name)
        work = info.path / "source.json.tmp"
        work.write_text(json.dumps({**info.source, "weights": weights}, indent=2))
        work.rename(info.path / "source.json")

    def variant_sizes(self, name: str) -> dict[str, int]:
        """Bytes on disk of each stored weight variant, params/'s dtype first: {"float32": ..., "int4": ...}."""
        info = self.info(name)
        dirs = [(info.config.dtype, info.path / "params")]
        dirs += [(p.name.removeprefix("params-"), p) for p in sorted(info.path.glob("params-*")) if p.is_dir()]
        return {dtype: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for dtype, d in dirs}

    @staticmethod
    def _write_variant(info: ModelInfo, config: ModelConfig, path: Path, variant: dict) -> None:
        work = Path(tempfile.mkdtemp(prefix=f"params-{config.dtype}-", dir=info.path))
        try:
            save_params(work / "params", pack_for_store(variant, config, path))
            (work / "params").rename(path)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def save(
        self,
        name: str,
        config: ModelConfig,
        params: dict,
        tokenizer: Tokenizer | None,
        source: dict,
        overwrite: bool = False,
    ) -> Path:
        """Write everything into a work dir, then rename it into place: a crash leaves no half model."""
        final = self.path(name)
        if final.exists() and not overwrite:
            raise FileExistsError(f"model {name!r} already exists at {final} (use --overwrite)")
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_root))
        try:
            (work / "config.json").write_text(config.to_json())
            (work / "source.json").write_text(json.dumps(source, indent=2))
            if tokenizer is not None:
                tokenizer.save(work / "tokenizer")
            save_params(work / "params", pack_for_store(params, config, work / "params"))
            self.models_dir.mkdir(parents=True, exist_ok=True)
            if final.exists():
                trash = Path(tempfile.mkdtemp(prefix="old-", dir=tmp_root))
                final.rename(trash / name)
                work.rename(final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                work.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return final


def serving_weights(store: ModelStore, name: str, requested: str | None) -> str | None:
    """--weights as given; else bf16 on an accelerator and, on a CPU, the variant the model was converted
    to serve (a quantized GGUF's own precision, source.json "weights": int4 or int8, run by the CPU
    kernels) or f32 (`default_weights`), for a KV model. A Transformer-VQ model keeps its stored weights
    unless asked (it has no variants)."""
    info = store.info(name)
    if requested is None and info.config.memory == "vq":
        return None
    backend = jax.default_backend()
    if requested is None and backend == "cpu" and info.source.get("weights"):
        return default_weights(backend, info.source["weights"])
    return default_weights(backend, requested)
