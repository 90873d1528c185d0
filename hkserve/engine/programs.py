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

import functools
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import jax

Key = tuple[Hashable, ...]  # (name..., the host arguments' (shape, dtype) signature)


def abstract(tree) -> Any:
    """The arrays of `tree` as ShapeDtypeStructs with their shardings (what a lowering needs of them)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


class ProgramTable:
    """The executables of one engine by key, thread-safe. A key is compiled once, by whoever asks
    first; whoever asks while it compiles waits for that compile (one lock for the table, held only
    to look up and to claim a key: the compiles themselves run unlocked, several keys at once)."""

    def __init__(self, compiler_options: dict[str, str] | None = None):
        """`compiler_options`: XLA's, for every program of the table (compiler_options.py)."""
        self.compiler_options = compiler_options or {}
        self._lock = threading.Lock()
        self._done: dict[Key, jax.stages.Compiled] = {}
        self._building: dict[Key, Future] = {}

    def __len__(self) -> int:
        """Programs compiled so far (or loaded from the persistent compile cache)."""
        return len(self._done)

    def has(self, key: Key) -> bool:
        return key in self._done

    def get(self, key: Key, build: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The executable of `key`: compiled by `build` now unless it is, or is being, compiled."""
        done = self._done.get(key)  # the loop's path once compiled: no lock
        if done is not None:
            return done
        with self._lock:
            done = self._done.get(key)
            if done is not None:
                return done
            future = self._building.get(key)
            mine = future is None
            if mine:
                future = self._building[key] = Future()
        if not mine:
            return future.result()  # another thread's compile of this key: wait for it (or its error)
        try:
            done = build()
        except BaseException as e:
            with self._lock:
                del self._building[key]
            future.set_exception(e)
            raise
        with self._lock:
            self._done[key] = done
            del self._building[key]
        future.set_result(done)
        return done


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
        # The loop's path: each host signature's executable, found without building a table key (a
        # key costs ~10 us a call; the tiny model's whole step ~1 ms: docs/benchmarks.md).
        self._by_signature: dict[tuple, jax.stages.Compiled] = {}

    @staticmethod
    def _signature(host: tuple) -> tuple:
        """The host arguments' (shape, dtype) per leaf, as they come: hashable, nothing converted."""
        return tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(host))

    def key(self, args: tuple) -> Key:
        leaves = jax.tree_util.tree_leaves(args[len(self.fixed) :])
        return (*self.name, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))

    def compile(self, *args) -> jax.stages.Compiled:
        """The executable for these arguments (the fixed ones may be abstract): compiled if need be,
        nothing run."""
        return self.table.get(self.key(args), lambda: self._lower(args).compile(self.table.compiler_options))

    def full_args(self, host: tuple) -> tuple:
        """The arguments of a call with these host arguments: the params and state as abstract values."""
        return (*(self.fixed[i] for i in sorted(self.fixed)), *host)

    def _lower(self, args: tuple):
        jitted = jax.jit(functools.partial(self.fn), **self.jit_options)  # fresh: see the class docstring
        return jitted.lower(*(self.fixed.get(i, a) for i, a in enumerate(args)))

    def __call__(self, *args):
        signature = self._signature(args[len(self.fixed) :])
        executable = self._by_signature.get(signature)
        if executable is None:  # first call of this signature here: the table's (compiled if need be)
            executable = self._by_signature[signature] = self.compile(*args)
        return executable(*args)
