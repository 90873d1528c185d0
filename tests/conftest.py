"""pytest fixtures only (shared helpers live in helpers.py): the golden SmolLM2 outputs, a SmolLM2 store
pulled once per run and one compile cache per run, both shared by the pytest-xdist workers of `make test`;
the compiles a test causes. And the files' order: longest first (tests/file_seconds.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import pytest
from filelock import FileLock
from helpers import hkserve, require_fixtures

from hkserve.checkpoint.store import ModelStore
from hkserve.cli.compile_cache import enable_compile_cache
from hkserve.kernels.build import CACHE_ENV, cache_root


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files longest first, by the seconds tests/file_seconds.json measured (a file not in it: 0, after
    them, in collection order), each file's tests in their order. `make test` passes xdist
    `--no-loadscope-reorder`, so its workers take the files in this order: the long end-to-end files
    start early and the two workers end together, instead of one running the device check's dry run
    alone at the end (xdist's default queues files by test count, and those files have one or two)."""
    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.path.name, index)
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0), first[item.path.name]))


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A folder of this run shared by its xdist workers (each has its own basetemp below the run's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def compile_cache(run_dir) -> Path | None:
    """One persistent XLA compile cache for the whole run, in this process and every `hkserve` or worker
    subprocess (they inherit HKSERVE_COMPILE_CACHE): the same programs are compiled by many tests. Each
    run starts with an empty one; HKSERVE_COMPILE_CACHE set outside (a path, or off) is kept."""
    os.environ.setdefault("HKSERVE_COMPILE_CACHE", str(run_dir / "xla-cache"))
    return enable_compile_cache()


@pytest.fixture(scope="session", autouse=True)
def kernel_cache() -> None:
    """The C++ kernels' library built once (in the outer store's cache) for every test's store and `hkserve`
    subprocess (they inherit HKSERVE_KERNEL_CACHE): float models run the decode-attention kernel too, and
    each fresh HKSERVE_HOME compiled it again (~13 s of CPU). HKSERVE_KERNEL_CACHE set outside is kept."""
    os.environ.setdefault(CACHE_ENV, str(cache_root()))


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads((require_fixtures() / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_home(run_dir) -> Path:
    """An HKSERVE_HOME into which `hkserve pull` fetched and converted the default model; or, where
    HKSERVE_TEST_HOME is set (machines without network: scripts/device-check.sh), that store, which must
    hold the model already."""
    if os.environ.get("HKSERVE_TEST_HOME"):
        home = Path(os.environ["HKSERVE_TEST_HOME"])
        assert (home / "models" / "smollm2-135m-instruct" / "config.json").is_file(), f"no SmolLM2 in {home}"
        return home
    home = run_dir / "hkhome"
    with FileLock(run_dir / "hkhome.lock"):  # the first worker pulls, the others wait for it
        if not (home / "models" / "smollm2-135m-instruct" / "config.json").is_file():
            # the float32 master only: the suite's SmolLM2 tests check float32 against float32 references
            # (a plain pull would also store its Q4_1 blocks as int4, the CPU's default since issue 36)
            result = hkserve("pull", "--quiet", "--weights", "f32", home=home)
            assert (home / "models" / "smollm2-135m-instruct" / "config.json").is_file(), result.stderr
    return home


@pytest.fixture(scope="session")
def smollm2(smollm2_home):
    """(store, model info, tokenizer, params) of the pulled SmolLM2."""

    store = ModelStore(smollm2_home)
    name = "smollm2-135m-instruct"
    return store, store.info(name), store.tokenizer(name), store.params(name)


@pytest.fixture
def compiles(monkeypatch):
    """The programs XLA compiles (or loads from the persistent cache) while the test runs, one event each.
    Without the program index (engine/program_index.py), which loads an engine's programs from earlier
    tests' entries with no such event: the tests that count them count the loads of the tables opened here."""
    monkeypatch.setenv("HKSERVE_PROGRAM_INDEX", "off")
    seen: list[str] = []

    def listener(event, _secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)
