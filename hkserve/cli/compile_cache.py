"""A persistent XLA compile cache for every `hkserve` command.

A restarted `hkserve serve` (and every later `generate`, `sample`, `bench`) loads the compiled prefill,
score and step executables from disk instead of compiling them again, so warm-up after the first start
takes a fraction of the time. The cache key is JAX's (the lowered program, compile options, device
assignment, jax/XLA versions): a changed model, dtype, mesh or jax version compiles afresh, and a loaded
executable is the one the compiler would have produced, so outputs do not change.

HKSERVE_COMPILE_CACHE: the directory (default $HKSERVE_HOME/compile-cache), or "off".
Size is bounded: JAX evicts the least recently used entries above HKSERVE_COMPILE_CACHE_MAX_MB (4096).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from hkserve.checkpoint.store import store_root

OFF = ("off", "0", "none", "false")


def enable_compile_cache() -> Path | None:
    """Point JAX at the cache directory named by the environment; return it, or None when it is off."""
    setting = os.environ.get("HKSERVE_COMPILE_CACHE", "").strip()
    if setting.lower() in OFF:
        return None
    path = Path(setting).expanduser() if setting else store_root() / "compile-cache"
    max_mb = int(os.environ.get("HKSERVE_COMPILE_CACHE_MAX_MB", "4096"))
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every compile, however quick or small: the engine's are seconds each, and the many small
    # ones (warm-up helpers, samplers) add up to seconds more at each start. A warm start then compiles
    # nothing (tests/test_startup.py). -1 for the size: no minimum, and none that JAX may substitute for
    # the filesystem (0 lets it).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", max_mb * 1024 * 1024)
    return path
