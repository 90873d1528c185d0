"""The persistent compile cache: a second `hkserve` run loads the executables the first one stored (by
default under the store home) and answers the same; "off" neither reads nor writes it."""

from __future__ import annotations

from helpers import hkserve
from test_serve import tiny_home  # noqa: F401  (module-scoped fixture: a tiny GGUF model in a store)

GENERATE = ("generate", "--model", "tiny", "--ids", "5,6,7,8", "--output-ids", "--max-tokens", "12")
GENERATE += ("--temperature", "0.8", "--seed", "3", "--max-len", "64")


def executables(cache) -> dict[str, int]:
    """The stored executables and when each was written (JAX keeps an access-time file beside each)."""
    return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name.endswith("-cache")}


def test_a_second_run_loads_the_stored_executables_and_answers_the_same(tiny_home):  # noqa: F811
    default = {"HKSERVE_COMPILE_CACHE": ""}  # the session's shared cache is replaced by the default place
    cache = tiny_home / "compile-cache"
    first = hkserve(*GENERATE, home=tiny_home, env=default)
    stored = executables(cache)
    assert stored  # the prefill, step and sampler programs

    second = hkserve(*GENERATE, home=tiny_home, env=default)
    assert second.stdout == first.stdout and len(first.stdout.split(",")) == 12
    # Everything the second run needed was found: no new executable, none rewritten.
    assert executables(cache) == stored

    everything = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}  # access times included
    off = hkserve(*GENERATE, home=tiny_home, env={"HKSERVE_COMPILE_CACHE": "off"})
    assert off.stdout == first.stdout
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == everything
