#!/opt/hkserve/bin/python
"""The image's entrypoint: `hkserve serve` with every serve flag settable by an HKSERVE_* variable.

The variable of a flag is its long name in capitals: --max-len → HKSERVE_MAX_LEN, --kernels →
HKSERVE_KERNELS. A switch takes 1/true/yes/on or 0/false/no/off; a repeatable flag (--cors-origin)
takes a comma-separated list. The names come from `hkserve serve`'s own parser, so a flag added there
is settable here without a change. Variables hkserve reads itself (the API key, the multi-host
settings) are left to it: a key on the command line would show in `ps`.

A variable starting with HKSERVE_ that is neither a flag's nor one hkserve reads is refused: a typo
(HKSERVE_SLOT=32) must not start a server that silently ignores it.

`docker run IMAGE` serves; `docker run IMAGE --slots 32` serves with more flags (after the
variables', so they win); `docker run IMAGE hkserve pull NAME` runs that command instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping

PREFIX = "HKSERVE_"
# Read by hkserve itself (not passed as flags), or settings that are not serve flags.
READ_BY_HKSERVE = frozenset(
    {
        "HKSERVE_HOME",  # the model store (checkpoint/store.py), also the compile and kernel caches
        "HKSERVE_API_KEY",  # cli/serve.py
        "HKSERVE_COORDINATOR",  # multihost/hosts.py
        "HKSERVE_NUM_HOSTS",
        "HKSERVE_HOST_ID",
        "HKSERVE_HOSTS_MESH",
        "HKSERVE_CONTROL_PORT",
        "HKSERVE_CONTROL_BIND",
        "HKSERVE_CONTROL_SECRET",  # multihost/control.py
        "HKSERVE_CONTROL_SECRET_FILE",
        "HKSERVE_COMPILE_CACHE",  # cli/compile_cache.py
        "HKSERVE_COMPILE_CACHE_MAX_MB",
        "HKSERVE_PROGRAM_INDEX",  # engine/program_index.py (off | verify)
        "HKSERVE_KERNEL_THREADS",  # kernels/dispatch.py
        "HKSERVE_KERNEL_ISA",  # kernels/dispatch.py (avx2: force the AVX2 paths)
        "HKSERVE_KERNEL_CACHE",  # kernels/build.py (tests: one library for every store)
        "HKSERVE_PAGED_ATTENTION",  # model/paged_memory.py: the paged decode's attention path (A/B)
        "HKSERVE_INT4_MATMUL",  # model/int4_pallas.py: int4 linears through XLA or the Pallas kernel (GPUs)
        "HKSERVE_XLA_DEFAULTS",  # cli/xla_flags.py
        "HKSERVE_TRAIN_KILL_AFTER_STEP",  # train/loop.py (tests)
        "HKSERVE_TEST_HOME",  # tests/conftest.py
    }
)
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
# Kubernetes puts a Service's address in every pod of its namespace as NAME_SERVICE_HOST, NAME_PORT_80_TCP...:
# a Service named hkserve* makes HKSERVE_ variables (and HKSERVE_PORT=tcp://...) nobody set.
SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT)|_PORT_\d+_(TCP|UDP|SCTP)")
LINKS_HINT = " (Kubernetes service links of a Service named hkserve*: set enableServiceLinks: false in the pod)"


def serve_parser() -> argparse.ArgumentParser:
    from hkserve.cli.main import build_parser  # imports JAX: only when serving

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def env_name(action: argparse.Action) -> str:
    flag = next(s for s in action.option_strings if s.startswith("--"))
    return PREFIX + flag[2:].upper().replace("-", "_")


def _switch(name: str, value: str) -> bool:
    if value.strip().lower() in TRUE:
        return True
    if value.strip().lower() in FALSE:
        return False
    raise SystemExit(f"hkserve-entrypoint: {name}={value!r}: expected one of {TRUE + FALSE[:-1]}")


def flags_from_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """The serve flags the environment sets; refuses an HKSERVE_* variable nobody reads."""
    flags: list[str] = []
    known = set(READ_BY_HKSERVE)
    for action in parser._actions:
        if not any(s.startswith("--") for s in action.option_strings) or action.dest == "help":
            continue
        name = env_name(action)
        known.add(name)
        if name in READ_BY_HKSERVE or name not in environ:
            continue
        value, flag = environ[name], next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if _switch(name, value) else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true / store_false
            if _switch(name, value):
                flags.append(flag)
        elif isinstance(action, argparse._AppendAction):
            flags += [f"{flag}={item.strip()}" for item in value.split(",") if item.strip()]
        else:
            flags.append(f"{flag}={value}")
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    if unknown:
        links = any(SERVICE_LINK.search(k) for k in unknown)
        raise SystemExit(
            f"hkserve-entrypoint: unknown setting(s) {', '.join(unknown)}: a serve flag --x-y is HKSERVE_X_Y "
            f"(`hkserve serve --help`); also read: {', '.join(sorted(READ_BY_HKSERVE))}" + (LINKS_HINT if links else "")
        )
    return flags


def main(argv: list[str]) -> None:
    if argv and not argv[0].startswith("-"):  # another command: `hkserve pull ...`, `bash`
        command = argv
    else:
        command = ["hkserve", "serve", *flags_from_env(serve_parser(), os.environ), *argv]
        print("hkserve-entrypoint:", " ".join(command), file=sys.stderr, flush=True)
    os.execvp(command[0], command)  # the command replaces this process: signals reach it directly


if __name__ == "__main__":
    main(sys.argv[1:])
