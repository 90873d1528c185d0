"""Run mutmut's mutants in one process, for a machine too loaded for `make mutate` to finish.

`make mutate` forks a pytest run per mutant; on 2 cores shared with other work that start-up alone took
most of a minute per mutant. This driver uses the mutants and stats of a `make mutate` run (mutants/,
after at least its stats phase) and, for each mutant, sets MUTANT_UNDER_TEST (mutmut's trampolines
read it on every call) and calls the test functions of one file, fastest first, stopping at the first
failure, as mutmut's `pytest -x` does. Every test of the file runs for every mutant (a test that never
reaches the mutated function passes either way), so a test that mutmut's stats did not map to a
function still counts. JAX's trace caches are cleared per mutant; the persistent compilation cache
(mutants/.jax-cache) serves the programs a mutant does not change.

    .venv/bin/python tests/mutate_inprocess.py hkserve/model/sampling.py tests/test_sampling.py out.json

Results go to out.json ({mutant: [status, first failure, seconds]}), and it resumes from that file.
A mutant whose tests run past TIMEOUT_S (an endless loop) is stopped and counted killed, as mutmut
counts a timeout. An optional fourth argument keeps only the mutants of the functions it names
(comma-separated, e.g. `copy_prefix,set_table`), for a test file that checks part of a module.
Only for test files whose tests take no fixtures (parametrize is fine)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

TIMEOUT_S = 60  # per mutant: far above any file's whole run here, below a hang's cost


class MutantTimeout(BaseException):
    """Raised in the test by SIGALRM: not an Exception, so no test's own handler swallows it."""


def _timed_out(signum, frame):
    raise MutantTimeout


def main(module: str, test_file: str, out_path: str, functions: str = "") -> None:
    out = Path(out_path).resolve()
    os.chdir("mutants")
    sys.path[:0] = [os.getcwd(), str(Path("tests").resolve())]
    os.environ["MUTANT_UNDER_TEST"] = ""  # the original code

    import jax
    import pytest

    jax.config.update("jax_compilation_cache_dir", str(Path(".jax-cache").resolve()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    items: list = []

    class Collect:
        def pytest_collection_modifyitems(self, items):
            collected.extend(items)

    collected = items
    pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", test_file], plugins=[Collect()])
    durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
    names = sorted(json.loads(Path(module + ".meta").read_text())["exit_code_by_key"])
    if functions:  # mutmut's names: module.x_function__mutmut_N (x_Classǁmethod__mutmut_N for methods)
        names = [n for n in names if n.rsplit("__mutmut_", 1)[0].rsplit(".x_", 1)[-1] in functions.split(",")]

    def run(name: str) -> tuple[str, str | None]:
        os.environ["MUTANT_UNDER_TEST"] = name
        jax.clear_caches()
        signal.alarm(TIMEOUT_S)
        try:
            for item in items:
                try:
                    item.obj(**getattr(getattr(item, "callspec", None), "params", {}))
                except (Exception, pytest.fail.Exception) as e:  # pytest.raises fails with a BaseException
                    return "killed", f"{item.nodeid}: {type(e).__name__}: {str(e)[:200]}"
        except MutantTimeout:
            return "killed", f"timeout: over {TIMEOUT_S} s"
        finally:
            signal.alarm(0)
        return "survived", None

    signal.signal(signal.SIGALRM, _timed_out)

    baseline = run("")
    if baseline[0] != "survived":
        raise SystemExit(f"the unmutated code fails: {baseline[1]}")
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        if name in results:
            continue
        started = time.monotonic()
        status, why = run(name)
        results[name] = [status, why, round(time.monotonic() - started, 2)]
        print(f"{name}: {status} ({results[name][2]} s) {why or ''}"[:300], flush=True)
        out.write_text(json.dumps(results, indent=0))
    statuses = [status for status, *_ in results.values()]
    killed = statuses.count("killed")
    print(f"{module}: {killed}/{len(statuses)} killed = {killed / len(statuses):.1%}")
    for name, (status, *_) in sorted(results.items()):
        if status != "killed":
            print(f"    survived: {name}")


if __name__ == "__main__":
    main(*sys.argv[1:])
