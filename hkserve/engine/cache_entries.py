"""An evicted executable loaded again straight from its entry in JAX's persistent compile cache:
nothing traced, lowered or compiled.

JAX finds an entry by a key it computes from the lowered module, so loading a program through
`jit(...).lower(...).compile()` traces and lowers it first: on SmolLM2 that was 432 of a reload's
631 ms (docs/benchmarks.md, Start-up). Instead the key JAX computed at the program's first load is
noted (its cache reads pass through `_note_key`, on the loading thread), and a reload reads that entry
and deserializes it, then wraps it as the first load did (the executable's shardings, avals and
pytrees, kept from the first load, a few KiB). `jax.experimental.serialize_executable` cannot do it:
an executable that was itself loaded from the cache serializes without its kernels on XLA:CPU (jaxlib
0.10.2: "Function wrapped_iota not found" when the copy runs), and a warm start loads every program
from the cache. The entry is JAX's own file: no copy in memory or on disk. It may be gone (the cache
is bounded, `HKSERVE_COMPILE_CACHE_MAX_MB`): `load` then says so and the table compiles as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any, NamedTuple

import jax
from jax._src import compilation_cache  # the persistent cache's read, by the key JAX computed

log = logging.getLogger("hkserve.programs")
_here = threading.local()
_read = compilation_cache.get_executable_and_time  # JAX's own, before `_note_key` wraps it


class Entry(NamedTuple):
    """What loading an executable from its cache entry needs, without the executable itself."""

    cache_key: str
    compile_options: Any  # xla_client.CompileOptions, as JAX read the entry with them
    shell: Any  # the executable's UnloadedMeshExecutable with its xla_executable dropped
    const_args: list
    args_info: Any
    out_tree: Any
    no_kwargs: bool
    in_types: Any
    out_types: Any


@functools.cache
def _note_keys() -> None:
    """Wrap JAX's cache read to note, per thread, the key and options of the last entry looked up."""

    def read(cache_key, compile_options, *args, **kwargs):
        _here.noted = (cache_key, compile_options)
        return _read(cache_key, compile_options, *args, **kwargs)

    compilation_cache.get_executable_and_time = read


def start_noting() -> None:
    """From now on, this thread's next cache lookup is noted (call before a program's first load)."""
    _note_keys()
    _here.noted = None


def noted() -> tuple[str, Any] | None:
    """(key, compile options) of this thread's last cache lookup since `start_noting`; None: none."""
    return getattr(_here, "noted", None)


def entry_of(executable: jax.stages.Compiled, key_and_options: tuple[str, Any]) -> Entry | None:
    """The entry of a loaded `executable` (None: not a single mesh executable JAX can rebuild, or a
    JAX whose private `Compiled` parts differ from these: the program then simply stays loaded)."""
    try:
        unloaded = getattr(executable._executable, "_unloaded_executable", None)
        if unloaded is None or not dataclasses.is_dataclass(unloaded):
            return None
        params = executable._params
        shell = dataclasses.replace(unloaded, xla_executable=None)
        return Entry(*key_and_options, shell, params.const_args, executable.args_info, executable.out_tree,
                     params.no_kwargs, params.in_types, params.out_types)  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        _unsupported_once(jax.__version__)
        return None


@functools.cache
def _unsupported_once(version: str) -> None:
    log.warning("jax %s: compiled programs cannot be rebuilt from cache entries; none is evicted", version)


def load(entry: Entry) -> jax.stages.Compiled | None:
    """The executable of `entry`, deserialized from JAX's cache file (None: the entry is gone)."""
    shell = entry.shell
    xla_executable, _ = _read(entry.cache_key, entry.compile_options, shell.backend, shell.device_list)
    if xla_executable is None:
        return None
    mesh_executable = dataclasses.replace(shell, xla_executable=xla_executable).load()
    return jax.stages.Compiled(mesh_executable, entry.const_args, entry.args_info, entry.out_tree,
                               entry.no_kwargs, entry.in_types, entry.out_types)  # fmt: skip
