"""The cache entries of an engine's programs kept on disk across processes, so that a warm start
loads each program straight from JAX's persistent compile cache: nothing traced or lowered.

JAX finds a program's cache entry by a key it computes from the lowered module: a warm start traced
and lowered every program only to compute it (SmolLM2 int8 on the Zen 4 VM: 2.7 s + 4.6 s of 13.2 s,
docs/benchmarks.md). The first load of a program in a process notes its `cache_entries.Entry`; this
index keeps those entries beside the compile cache, one file per *identity* (program_identity.py:
everything a lowering can depend on besides the program itself: sources, versions, jax config,
environment, CPU, devices), each entry under a key that describes the program (its table key,
function with all it reaches, jit options, abstract params and state, compiler options). A later
process with the same identity and the same description loads the entry through `cache_entries.load`.

Pickled as `jax.experimental.serialize_executable` pickles an executable: the devices and the
backend by persistent ids, restored from the running process; the compile options as XLA's bytes.
Written atomically (tmp + rename) after each new entry, merged under a file lock with what other
processes of the same identity wrote meanwhile; at most `MAX_IDENTITIES` files, the least
recently used removed; an unreadable file or entry is logged and ignored (the programs are then
built as without the index, and their entries written again).

HKSERVE_PROGRAM_INDEX=verify (tests): every indexed program is lowered too and JAX's key compared
with the indexed one (a mismatch raises `StaleEntry`: a difference the description missed);
HKSERVE_PROGRAM_INDEX=off: no index.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pickle
import threading
from pathlib import Path

import jax
from jax._src.lib import xla_client as xc

from hkserve.engine import cache_entries

log = logging.getLogger("hkserve.programs")
ENV = "HKSERVE_PROGRAM_INDEX"  # "off" | "verify" | "" (on)
FOLDER = "hkserve-program-index"  # inside JAX's compile cache folder
MAX_IDENTITIES = 16
FORMAT = 1


class StaleEntry(AssertionError):
    """An indexed cache key differs from the one JAX computes: the identity misses something."""


def mode() -> str:
    return os.environ.get(ENV, "").strip().lower()


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, xc.Device):
            return ("device", obj.id)
        if isinstance(obj, xc.Client):
            return ("client",)
        if isinstance(obj, xc.DeviceList):
            return ("devices", tuple(d.id for d in obj))
        if isinstance(obj, xc.CompileOptions):
            return ("options", obj.SerializeAsString())
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.backend = jax.devices()[0].client
        self.devices = {d.id: d for d in jax.devices()}

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "device":
            return self.devices[pid[1]]
        if kind == "client":
            return self.backend
        if kind == "devices":
            return xc.DeviceList(tuple(self.devices[i] for i in pid[1]))
        if kind == "options":
            return xc.CompileOptions.ParseFromString(pid[1])
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def dumps(entry: cache_entries.Entry) -> bytes:
    with io.BytesIO() as file:
        _Pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(entry)
        return file.getvalue()


def loads(data: bytes) -> cache_entries.Entry:
    entry = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(entry, cache_entries.Entry):
        raise pickle.UnpicklingError(f"not an entry: {type(entry).__name__}")
    return entry


class ProgramIndex:
    """One identity's entries: program description -> pickled Entry, in memory and in one file."""

    def __init__(self, folder: Path, identity: str, verify: bool = False):
        self.path, self.verify = folder / f"{identity}.pkl", verify
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = self._read()

    def _read(self, quiet: bool = False) -> dict[str, bytes]:
        """The file's entries (still pickled); {} where there is none or it is unreadable (logged
        unless `quiet`)."""
        try:
            with self.path.open("rb") as file:
                version, data = pickle.load(file)  # dict[str, bytes]: plain types only
            if version != FORMAT or not isinstance(data, dict):
                raise ValueError(f"format {version!r}")
            os.utime(self.path)  # recently used: kept by `_bound`
            return data
        except FileNotFoundError:
            return {}
        except Exception as e:
            if not quiet:
                log.warning("program index %s unreadable (%s): ignored, rebuilt", self.path, e)
            return {}

    def get(self, key: str) -> cache_entries.Entry | None:
        """The entry indexed under `key` (None: none, or unreadable); counts hits and misses."""
        data = self._data.get(key)
        entry = None
        if data is not None:
            try:
                entry = loads(data)
            except Exception as e:
                log.warning("program index %s: entry unreadable (%s): ignored", self.path, e)
        with self._lock:
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        return entry

    def miss(self) -> None:
        """An indexed entry that could not be loaded (gone from the cache): counted as a miss."""
        with self._lock:
            self.hits -= 1
            self.misses += 1

    def put(self, key: str, entry: cache_entries.Entry) -> None:
        """Index `entry` under `key` and write the file (atomically: tmp + rename)."""
        try:
            data = dumps(entry)
        except Exception as e:
            log.warning("program index: entry of %s not picklable (%s)", entry.cache_key, e)
            return
        with self._lock:
            if self._data.get(key) == data:
                return
            self._data[key] = data
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # Read, merge and replace under a lock: another process of the same identity (a test
                # worker, a replica on a shared cache) may have written entries since this one read the
                # file, and the last writer would otherwise drop them.
                with self.path.with_suffix(".lock").open("a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self._data = {**self._read(quiet=True), **self._data}
                    tmp = self.path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
                    with tmp.open("wb") as file:
                        pickle.dump((FORMAT, self._data), file, protocol=pickle.HIGHEST_PROTOCOL)
                    tmp.replace(self.path)
            except OSError as e:
                log.warning("program index %s not written (%s)", self.path, e)
                return
        _bound(self.path.parent, keep=self.path)

    def status(self) -> dict:
        return {"index_hits": self.hits, "index_misses": self.misses}


def _bound(folder: Path, keep: Path) -> None:
    """At most MAX_IDENTITIES index files: the least recently used go."""
    try:
        files = sorted(folder.glob("*.pkl"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in [p for p in files if p != keep][MAX_IDENTITIES - 1 :]:
            old.unlink(missing_ok=True)
            old.with_suffix(".lock").unlink(missing_ok=True)
    except OSError as e:  # another process removed one meanwhile
        log.debug("program index bound: %s", e)


def open_index(identity: str) -> ProgramIndex | None:
    """The index of this identity beside JAX's compile cache; None when the cache or the index is off."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or mode() in ("off", "0", "false", "none"):
        return None
    return ProgramIndex(Path(directory) / FOLDER, identity, verify=mode() == "verify")
