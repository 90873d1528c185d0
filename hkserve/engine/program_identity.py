"""What a program's lowering can depend on, as a stable text: the key of its entry in the program
index (program_index.py), which skips tracing and lowering on a warm start.

It must be exact: an index entry found under a description that missed a difference would run a
wrong program. So it errs towards more: the process's part (`process_part`: hkserve's sources and
built kernel libraries, jax/jaxlib/haiku/numpy versions and every jax config value, the XLA/JAX/HKSERVE/TPU environment,
the CPU's flags and kernel ISA, the devices, the kernels being traced) and the program's part
(`describe` of its function with everything it reaches: the engine's attributes, the model's config
and kernels, closures, defaults, partials; its jit options; its params' and state's shapes, dtypes and
shardings; the compiler options). Arrays a function closes over are constants of its program: their
values are hashed; device arrays reached otherwise (the engine's params and state, which every program
takes as arguments) by their abstract values.
An object it cannot describe stably (a repr with an address) gives a description that differs at
each start: a miss, never a wrong hit. A miss only costs the path without the index.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import marshal
import os
import types
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hkserve.kernels import build, dispatch

ENV_PREFIXES = ("XLA_", "JAX_", "HKSERVE_", "TPU_", "LIBTPU_", "CUDA_VISIBLE", "NVIDIA_TF32")
LIBRARIES = ("jax", "jaxlib", "dm-haiku", "numpy", "ml_dtypes", "jax-cuda12-plugin", "libtpu")
SOURCE_SUFFIXES = (".py", ".cc", ".h", ".so")
PACKAGE = Path(__file__).resolve().parents[1]  # hkserve/
_ADDRESS = " at 0x"
SKIP = "skip"  # a type's __identity__ that is this: its objects are left out of the dicts that hold them
_VALUES = (
    jax.sharding.Sharding,
    jax.sharding.Mesh,
    jax.sharding.PartitionSpec,
    jax.Device,
)  # a default repr: not stable across processes


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def sources() -> str:
    """A hash of hkserve's own sources and the kernel libraries built for this machine."""
    h = hashlib.sha256()
    roots = [PACKAGE, build.cache_root()]
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def process_part() -> str:
    """What every program of this process depends on besides its own function and arguments."""
    config = {name: jax.config.values[name] for name in sorted(jax.config.values)}
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    backend = jax.devices()[0].client
    return describe(
        (
            sources(),
            {name: _version(name) for name in LIBRARIES},
            config,
            env,
            build.cpu_flags(),
            dispatch.machine_isa(),
            dispatch.active(),
            devices,
            jax.process_count(),
            backend.platform,
            backend.platform_version,
        )
    )


def describe(obj: Any) -> str:
    """A text of `obj` and all it reaches that is equal across processes for equal objects."""
    return _Describer().of(obj)


@dataclasses.dataclass
class _Describer:
    seen: dict[int, int] = dataclasses.field(default_factory=dict)  # id -> order: cycles, shared objects
    keep: list = dataclasses.field(default_factory=list)  # what was described: its ids stay unique meanwhile

    def of(self, obj: Any) -> str:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic, np.dtype, type)):
            return f"{type(obj).__name__}:{obj!r}" if not isinstance(obj, type) else _name(obj)
        if id(obj) in self.seen:
            return f"<#{self.seen[id(obj)]}>"
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        says = getattr(type(obj), "__identity__", None)  # an object that says what of it counts (a table)
        if says is not None:
            return f"{_name(type(obj))}<{'' if says is SKIP else self.of(obj.__identity__())}>"
        if isinstance(obj, _VALUES):  # their repr is their value
            return f"{_name(type(obj))}:{obj!r}"
        if isinstance(obj, np.ndarray):
            return f"nd{obj.shape}{obj.dtype}:{hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()}"
        if isinstance(obj, jax.Array):  # an argument (the engine's params, state): its abstract value
            return f"array{obj.shape}{obj.dtype}{obj.sharding!r}"
        if isinstance(obj, jax.ShapeDtypeStruct):
            return f"spec{obj.shape}{obj.dtype}{obj.sharding!r}"
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = sorted(map(self.of, obj)) if isinstance(obj, (set, frozenset)) else map(self.of, obj)
            return f"{_name(type(obj))}[{','.join(items)}]"
        if isinstance(obj, dict):  # without the programs it holds (a cache of them, filled as they load)
            items = (f"{self.of(k)}:{self.of(v)}" for k, v in obj.items() if not _skipped(v))
            return "{" + ",".join(sorted(items)) + "}"
        if isinstance(obj, functools.partial):
            return f"partial({self.of(obj.func)},{self.of(obj.args)},{self.of(obj.keywords)})"
        if isinstance(obj, types.MethodType):
            return f"method({self.of(obj.__func__)},{self.of(obj.__self__)})"
        if isinstance(obj, types.FunctionType):
            return self._function(obj)
        if isinstance(obj, (types.BuiltinFunctionType, types.ModuleType)):
            return f"{getattr(obj, '__module__', '')}.{obj.__name__}"
        fields = _fields(obj)
        if fields:
            return f"{_name(type(obj))}({self.of(fields)})"
        text = repr(obj)  # the backend's own types: their repr is their value where it has no address
        return f"{_name(type(obj))}:{text if _ADDRESS not in text else id(obj)}"

    def _function(self, fn: types.FunctionType) -> str:
        """Its name and code (a function from outside hkserve's sources too), and what it closes over
        or defaults to."""
        code = hashlib.sha256(marshal.dumps(fn.__code__)).hexdigest()
        cells = [_constants(c.cell_contents) for c in fn.__closure__ or () if _filled(c)]
        defaults = [fn.__defaults__, fn.__kwdefaults__]
        return f"fn({fn.__module__}.{fn.__qualname__}:{code},{self.of(cells)},{self.of(defaults)})"


def _skipped(value: Any) -> bool:
    return getattr(type(value), "__identity__", None) is SKIP


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _constants(value: Any) -> Any:
    """The device arrays a function closes over (in any pytree) are constants of its program: their
    values count (a deleted one, donated, cannot be one: its abstract value)."""
    try:
        return jax.tree_util.tree_map(lambda x: np.asarray(x) if _live(x) else x, value)
    except Exception:  # a pytree that cannot be rebuilt: described as nothing else is (a miss)
        return object()


def _live(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_deleted()


def _fields(obj: Any) -> dict:
    fields = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(obj, slot) and slot != "__weakref__":
                fields[slot] = getattr(obj, slot)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        fields.update(obj._asdict())
    return fields


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
