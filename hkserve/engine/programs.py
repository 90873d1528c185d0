"""An engine's compiled programs, each built ahead of time (jit → lower → compile on abstract arguments)
and kept by key, so that whoever needs one first compiles it and nobody compiles it twice.

Ahead of time because a compile must never run the program nor read the live decode state: the
warm-up, the background compiler (background_compile.py) and the runner's loop each ask for programs,
and only the loop owns the (donated) state. The params and the state enter a lowering as their
abstract values (shape, dtype, sharding: fixed for the engine's life), the small host arguments as
themselves (numpy: their shape and dtype are what is compiled for). A `jax.stages.Compiled` is then
called with the real arguments exactly as the jitted function would be: numpy inputs are put on the
device with the program's in_shardings and the donated arguments are donated.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import jax

from hkserve.engine import cache_entries, program_identity, program_index

Key = tuple[Hashable, ...]  # (name..., the host arguments' (shape, dtype) signature)
# JAX's events of a program traced, and compiled or loaded from the persistent cache: a reload has neither
WORK_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

log = logging.getLogger("hkserve.programs")


def abstract(tree) -> Any:
    """The arrays of `tree` as ShapeDtypeStructs with their shardings (what a lowering needs of them)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


@dataclasses.dataclass
class Loaded:
    """One key's executable while it is loaded (None once evicted: JAX's persistent cache keeps it)."""

    executable: jax.stages.Compiled | None
    used: int  # the table's clock at its last call; compiled ahead of time and not called since: -clock
    cache_entry: cache_entries.Entry | None = None  # where a reload finds it; None (none noted): never evicted


class ProgramTable:
    """The executables of one engine by key, thread-safe. A key is compiled once, by whoever asks
    first; whoever asks while it compiles waits for that compile (one lock for the table, held only
    to look up and to claim a key: the compiles themselves run unlocked, several keys at once).

    At most `max_loaded` executables stay loaded (None: all): each costs ~5-9 MiB of host memory loaded
    (docs/benchmarks.md, Start-up), so past the bound the least recently called one is dropped, and
    deserialized from its entry in JAX's persistent compile cache when next called (cache_entries.py):
    a reload traces, lowers and compiles nothing (counted: `reload_misses` must stay 0), and the
    executable is the same. A dropped executable's memory goes back to the heap only, which glibc
    keeps: `on_evict` (serve's malloc_trim) returns it to the OS."""

    def __init__(self, compiler_options: dict[str, str] | None = None):
        """`compiler_options`: XLA's, for every program of the table (compiler_options.py)."""
        self.compiler_options = compiler_options or {}
        self.max_loaded: int | None = None
        self.on_evict: Callable[[], None] | None = None  # after evictions: serve gives the freed heap back
        self.reloads = self.reload_misses = self.evictions = 0
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self._done: dict[Key, Loaded] = {}  # every key compiled so far, loaded or evicted
        self._loaded = 0
        self._building: dict[Key, Future] = {}
        self._index: program_index.ProgramIndex | bool | None = False  # opened at the first load (False: not yet)

    def __identity__(self) -> dict[str, str]:
        """What of the table a program's lowering depends on (program_identity.py): its compiler options."""
        return self.compiler_options

    def index(self) -> program_index.ProgramIndex | None:
        """The entries of this process's identity on disk (program_index.py); None: the index is off."""
        if self._index is False:
            with self._lock:  # one index a table (its counts): opened once, whoever asks first
                if self._index is False:
                    identity = program_identity.digest(program_identity.process_part())
                    self._index = program_index.open_index(identity)
        return self._index

    def bound(self, max_loaded: int | None) -> None:
        """Keep at most `max_loaded` executables loaded from now on (None: no bound). Refused without
        JAX's persistent compile cache: an evicted program is reloaded from its entry there."""
        if max_loaded is not None:
            if max_loaded < 1:
                raise ValueError(f"at least one program must stay loaded, not {max_loaded}")
            if not persistent_cache_on():
                raise ValueError("a bound on the loaded programs needs the persistent compile cache (it is off)")
        with self._lock:
            self.max_loaded = max_loaded
            evicted = self._evict_over_bound(None)
        if evicted and self.on_evict is not None:
            self.on_evict()

    def __len__(self) -> int:
        """Programs compiled so far (or loaded from the persistent compile cache), loaded or evicted."""
        return len(self._done)

    def loaded(self) -> int:
        """Executables held now."""
        return self._loaded

    def status(self) -> dict:
        """The counts /health reports: programs compiled, loaded now, the bound, evictions and reloads."""
        return {
            "loaded": self._loaded,
            "max_loaded": self.max_loaded,
            "evictions": self.evictions,
            "reloads": self.reloads,
            "reload_misses": self.reload_misses,
            **(index.status() if (index := self.index()) is not None else {}),
        }

    def has(self, key: Key) -> bool:
        """Whether `key` was compiled (its executable loaded now, or evicted: in the persistent cache)."""
        return key in self._done

    def tick(self) -> int:
        return next(self._clock)

    def get(self, key: Key, build: Callable[[], jax.stages.Compiled], ahead: bool = False) -> jax.stages.Compiled:
        """The executable of `key`: compiled by `build` now unless it is, or is being, compiled."""
        return self.load(key, build, ahead)[1]

    def load(self, key: Key, build: Callable[[], jax.stages.Compiled], ahead: bool = False, described=None):
        """(its Loaded, the executable) of `key`, loaded by `build` now if need be: compiled, or
        deserialized from its cache entry once evicted. `ahead`: compiled for later, not called now
        (the warm-up's and background compiles), so it displaces no program in use. `described`: the
        program's description (program_identity.py), under which the index keeps its entry across
        processes (None: not indexed)."""
        entry = self._done.get(key)  # the loop's path once compiled: no lock
        executable = entry.executable if entry is not None else None
        if executable is not None:
            if not ahead:
                entry.used = self.tick()
            return entry, executable
        with self._lock:
            entry = self._done.get(key)
            executable = entry.executable if entry is not None else None
            if executable is not None:
                return entry, executable
            future = self._building.get(key)
            mine = future is None
            if mine:
                future = self._building[key] = Future()
        if not mine:
            return future.result()  # another thread's load of this key: wait for it (or its error)
        try:
            if entry is None:
                executable, cache_entry = self._indexed_load(build, described)
            else:
                executable, cache_entry = self._reload(key, entry, build)
        except BaseException as e:
            with self._lock:
                del self._building[key]
            future.set_exception(e)
            raise
        with self._lock:
            entry = self._done.setdefault(key, Loaded(None, 0))
            entry.cache_entry = cache_entry
            # Compiled ahead of time (warm-up, background): before every called one in the eviction
            # order, the latest first, so the smallest contexts (compiled first) stay and a rare
            # program compiled in the background goes at once, left in the persistent cache.
            entry.executable, entry.used = executable, -self.tick() if ahead else self.tick()
            self._loaded += 1
            evicted = self._evict_over_bound(None if ahead else entry)  # ahead: it may go at once
            del self._building[key]
        future.set_result((entry, executable))
        if evicted and self.on_evict is not None:
            self.on_evict()
        return entry, executable

    def _indexed_load(self, build, described: Callable[[], str] | None):
        """A program's first load here: from its entry in the index when there is one (nothing traced
        or lowered; in the verifying mode lowered too, and JAX's key compared), else `_first_load`, and
        its entry indexed."""
        index = self.index() if described is not None else None
        if index is None:
            return self._first_load(build)
        key = described()
        entry = index.get(key)
        executable = cache_entries.load(entry) if entry is not None else None
        if executable is not None:
            if index.verify:
                _, built = self._first_load(build)
                if built is None or built.cache_key != entry.cache_key:
                    raise program_index.StaleEntry(f"indexed key {entry.cache_key}, JAX's {built and built.cache_key}")
            return executable, entry
        if entry is not None:
            index.miss()  # its entry in the compile cache is gone (the cache is bounded)
        executable, cache_entry = self._first_load(build)
        if cache_entry is not None:
            index.put(key, cache_entry)
        return executable, cache_entry

    @staticmethod
    def _first_load(build: Callable[[], jax.stages.Compiled]) -> tuple[jax.stages.Compiled, cache_entries.Entry | None]:
        """A program compiled, or loaded from the persistent cache, and the cache entry JAX used."""
        cache_entries.start_noting()
        executable = build()
        noted = cache_entries.noted()
        return executable, cache_entries.entry_of(executable, noted) if noted is not None else None

    def _reload(
        self, key: Key, entry: Loaded, build: Callable[[], jax.stages.Compiled]
    ) -> tuple[jax.stages.Compiled, cache_entries.Entry | None]:
        """An evicted program, deserialized from its cache entry; one whose entry is gone (the cache is
        bounded) is loaded as the first time, and counted and logged, as is any reload that traced or
        compiled anything."""
        work = _work_here()
        executable, cache_entry = cache_entries.load(entry.cache_entry), entry.cache_entry
        gone = executable is None
        if gone:
            executable, cache_entry = self._first_load(build)
        with self._lock:
            self.reloads += 1
            missed = gone or _work_here() != work
            self.reload_misses += missed
        if missed:
            log.warning("program %s was evicted and traced or compiled again on its reload", key)
        return executable, cache_entry

    def _evict_over_bound(self, keep: Loaded | None) -> int:
        """Drop the least recently called executables beyond the bound (never `keep`); under the lock."""
        evicted = 0
        while self.max_loaded is not None and self._loaded > self.max_loaded:
            victims = [
                e
                for e in self._done.values()
                if e.executable is not None and e.cache_entry is not None and e is not keep
            ]
            if not victims:
                break
            min(victims, key=lambda e: e.used).executable = None
            self._loaded -= 1
            evicted += 1
        self.evictions += evicted
        return evicted


def persistent_cache_on() -> bool:
    """Whether JAX writes and reads its persistent compile cache (cli/compile_cache.py turns it on)."""
    return bool(jax.config.jax_compilation_cache_dir)


_here = threading.local()


@functools.cache
def _listen_for_work() -> None:
    """Count JAX's traces and compiles per thread (its events are recorded on the working thread)."""

    def listener(event: str, _secs: float, **_) -> None:
        if event in WORK_EVENTS:
            _here.work = getattr(_here, "work", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(listener)


def _work_here() -> int:
    """Traces and compiles (or loads from the persistent cache) on this thread so far, counted from
    the first reload on."""
    _listen_for_work()
    return getattr(_here, "work", 0)


class Program:
    """One function and its executables in the engine's table, one per signature of its host arguments
    (a prefill's tokens [1, bucket]: one per bucket). `fixed`: the positions of the arguments that are
    the params and the state, with their abstract values (their signature never changes); `jit_options`:
    jax.jit's (shardings, donation).

    Each lowering jits a fresh wrapper of `fn` that nothing keeps: JAX caches a lowering (its jaxpr, its
    MLIR module with an MLIR context of its own) in caches keyed weakly on the function jitted, so with
    a jitted function kept for the engine's life they stayed for its life too, unused (the loop calls
    the `Compiled` only): SmolLM2's 63 programs held 137 MiB that way. With the wrapper gone they go
    once compiled (docs/benchmarks.md, Start-up; tests/test_program_memory.py). A partial of `fn` has
    its name and source, so its programs and their cache keys are those of `fn` jitted itself."""

    def __init__(self, table: ProgramTable, name: tuple, fn: Callable, fixed: dict[int, Any], **jit_options):
        if sorted(fixed) != list(range(len(fixed))):
            raise ValueError(f"the fixed arguments come first, not at {sorted(fixed)}")
        self.table, self.name, self.fn, self.fixed, self.jit_options = table, name, fn, fixed, jit_options
        # The loop's path: each host signature's table entry, found without building a table key (a
        # key costs ~10 us a call; the tiny model's whole step ~1 ms: docs/benchmarks.md).
        self._by_signature: dict[tuple, Loaded] = {}

    @staticmethod
    def _signature(host: tuple) -> tuple:
        """The host arguments' (shape, dtype) per leaf, as they come: hashable, nothing converted."""
        return tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(host))

    # A program reached from another's function (the engine's table of them, filled as programs load)
    # is left out of its description: each program's own description covers it.
    __identity__ = program_identity.SKIP

    def key(self, args: tuple) -> Key:
        leaves = jax.tree_util.tree_leaves(args[len(self.fixed) :])
        return (*self.name, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))

    def compile(self, *args) -> jax.stages.Compiled:
        """The executable for these arguments (the fixed ones may be abstract), compiled ahead of time
        if need be, nothing run."""
        return self._load(args, ahead=True)[1]

    def _load(self, args: tuple, ahead: bool):
        build = lambda: self._lower(args).compile(self.table.compiler_options)
        return self.table.load(self.key(args), build, ahead, lambda: self._describe(args))

    def _describe(self, args: tuple) -> str:
        """The program at these arguments, all its lowering depends on besides the process (the index's
        key: program_identity.py): its name, function, jit options, the fixed arguments' abstract values,
        the host arguments' signature and structure, the table's compiler options."""
        host = args[len(self.fixed) :]
        parts = (
            self.key(args),
            str(jax.tree_util.tree_structure(host)),
            self.fn,
            self.jit_options,
            self.fixed,
            self.table,
        )
        return program_identity.digest(program_identity.describe(parts))

    def full_args(self, host: tuple) -> tuple:
        """The arguments of a call with these host arguments: the params and state as abstract values."""
        return (*(self.fixed[i] for i in sorted(self.fixed)), *host)

    def _lower(self, args: tuple):
        jitted = jax.jit(functools.partial(self.fn), **self.jit_options)  # fresh: see the class docstring
        return jitted.lower(*(self.fixed.get(i, a) for i, a in enumerate(args)))

    def __call__(self, *args):
        signature = self._signature(args[len(self.fixed) :])
        entry = self._by_signature.get(signature)
        executable = entry.executable if entry is not None else None
        if executable is None:  # first call of this signature here, or evicted since: the table's
            entry, executable = self._load(args, ahead=False)
            self._by_signature[signature] = entry
        else:
            entry.used = self.table.tick()
        return executable(*args)
