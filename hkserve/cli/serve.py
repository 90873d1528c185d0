"""`hkserve serve`: load a model, answer /health with 503 while warming up, serve with uvicorn, drain
on SIGTERM (stop admitting, let running requests finish, then stop the engine).

The listening socket is bound before the model loads, so a port in use fails at once with one line.
While draining the server keeps accepting connections: /health answers 503 "draining" and new
generations 503, until the runner has nothing running or waiting; only then does uvicorn close the
socket and finish the open responses. A second SIGTERM/SIGINT stops without waiting.

Multi-host (hkserve/multihost/): host 0 runs all of this over a LeaderEngine; the other hosts load
the same model onto their part of the mesh and replay host 0's engine calls, without HTTP."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import threading
import time
import types

import uvicorn

from hkserve.api import reasoning, tool_parsers
from hkserve.api.app import create_app
from hkserve.api.limits import ServerLimits, uvicorn_config
from hkserve.checkpoint.store import ModelStore
from hkserve.cli.loading import LoadOptions, load_engine
from hkserve.cli.memory import fix_mmap_threshold, release_code_pages, release_freed_heap
from hkserve.cli.startup import StartupTimeline
from hkserve.engine.background_compile import COMPILED_LINE, MODES, Compiles
from hkserve.engine.forwarding import base_engine
from hkserve.engine.programs import persistent_cache_on
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.warmup import COMMON_CONTEXT
from hkserve.multihost.control import Follower, Leader
from hkserve.multihost.hosts import HostFlags, HostGroup, LeaderEngine, exit_lost, follow

log = logging.getLogger("hkserve.serve")


# Executables kept loaded (--max-loaded-programs): SmolLM2's steady chat traffic called 9 of its 63,
# each ~5-9 MiB loaded; at 12 a second round of that traffic reloaded 1 program (~140 ms, a deserialize),
# at 8 it reloaded 4 (docs/benchmarks.md, Start-up: "A reload without tracing").
MAX_LOADED_PROGRAMS = 12
DRAIN_TIMEOUT_S = 300.0  # longest a drain waits for running requests before stopping anyway


class DrainingServer(uvicorn.Server):
    """uvicorn, but a shutdown signal first drains: /health 503, no new generations, running requests
    finish while the socket still answers; then uvicorn's own graceful shutdown."""

    def __init__(self, config: uvicorn.Config, app, runner: InferenceRunner):
        super().__init__(config)
        self.hk_app, self.runner = app, runner

    def handle_exit(self, sig, frame):
        if self.hk_app.state.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self.hk_app.state.draining = True
        log.info("draining: waiting for running requests before stopping")
        threading.Thread(target=self._exit_when_idle, args=(sig, frame), name="hkserve-drain", daemon=True).start()

    def _exit_when_idle(self, sig, frame) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            stats = self.runner.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
            time.sleep(0.05)
        super().handle_exit(sig, frame)


LIMIT_FLAGS = {  # flag: (ServerLimits field, help)
    "--max-body-bytes": ("max_body_bytes", "largest request body, as received (chunked or not): beyond, 413"),
    "--body-timeout": ("body_timeout_s", "seconds to receive a whole request body: beyond, 408"),
    "--header-timeout": ("header_timeout_s", "seconds for a request's head to arrive: beyond, the connection closes"),
    "--send-timeout": ("send_timeout_s", "seconds a response write waits for a client not reading: then closed"),
    "--keep-alive": ("keep_alive_s", "seconds an idle keep-alive connection stays open"),
    "--max-connections": ("max_connections", "connections open at once: beyond, 503"),
    "--max-stream-backlog": ("max_stream_backlog", "stream updates held for a slow client before it is cancelled"),
    "--cpu-threads": ("cpu_threads", "threads for parsing, chat templates and tokenizing"),
}


def add_limit_arguments(group) -> None:
    defaults = dataclasses.asdict(ServerLimits())
    for flag, (name, help_) in LIMIT_FLAGS.items():
        default = defaults[name]
        metavar = "SECONDS" if isinstance(default, float) else "N"
        group.add_argument(
            flag, dest=name, type=type(default), default=default, metavar=metavar, help=f"{help_} (default {default})"
        )


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """`hkserve serve`'s settings, read once from its flags and the environment (HKSERVE_API_KEY; the
    multi-host ones in HostGroup.from_flags)."""

    load: LoadOptions  # the model and how it loads
    hosts: HostFlags
    limits: ServerLimits
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 16
    max_queue: int = 64
    max_step_tokens: int | None = None  # a loop pass's tokens (decode rows + prompt chunks); None: the runner's default
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    web_page: bool = True  # the chat page at / (--no-web: off)
    reasoning_parser: str = "auto"  # api/reasoning.py CHOICES
    tool_call_parser: str = "auto"  # api/tool_parsers.py CHOICES
    compile: str = "background"  # engine/background_compile.py MODES (multi-host: always eager)
    compile_upto: int = COMMON_CONTEXT  # the longest context whose programs compile before ready
    max_loaded_programs: int = MAX_LOADED_PROGRAMS  # executables kept loaded at once; 0: all

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        given = vars(args)
        return cls(
            load=LoadOptions.from_args(args),
            hosts=HostFlags(args.coordinator, args.num_hosts, args.host_id, args.hosts_mesh),
            limits=ServerLimits(**{name: given[name] for name, _ in LIMIT_FLAGS.values()}),
            host=args.host,
            port=args.port,
            slots=args.slots,
            max_queue=args.max_queue,
            max_step_tokens=args.max_step_tokens,
            api_key=args.api_key or os.environ.get("HKSERVE_API_KEY") or None,
            cors_origins=tuple(args.cors_origin or ()),
            web_page=not args.no_web,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            compile=args.compile,
            compile_upto=args.compile_upto,
            max_loaded_programs=args.max_loaded_programs,
        )


def int_at_least(minimum: int):
    """An argparse type: an int of at least `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    return parse


positive_int = int_at_least(1)


def add_step_tokens_argument(parser) -> None:
    parser.add_argument(
        "--max-step-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens one loop pass carries: the running rows' decode tokens plus at most N - rows (padded) "
        "tokens of prompt prefill, cut into chunks of the largest prefill bucket that fits N - rows, so a "
        "long prompt is prefilled over several passes while the running streams keep decoding (default: on "
        "the CPU no fixed N: a pass's prompt tokens are max(32, rows) in whole chunks, so a pass "
        "with a chunk stays within ~2x the decode step alone at 16 and 64 rows and a crowded server keeps "
        "admitting (docs/benchmarks.md); slots + 512, the largest bucket, on accelerators)",
    )


def add_compile_argument(parser) -> None:
    parser.add_argument(
        "--compile",
        choices=MODES,
        default="background",
        help="when the programs compile: eager = all before /health turns ready; background = those of "
        "contexts up to --compile-upto tokens before, the rest after it on a thread; lazy = the rest when a "
        "request first needs one (it waits for that compile). Multi-host serving is always eager",
    )
    parser.add_argument(
        "--compile-upto",
        type=positive_int,
        default=COMMON_CONTEXT,
        metavar="TOKENS",
        help=f"the longest context whose programs compile before ready (background, lazy; default {COMMON_CONTEXT})",
    )


def add_loaded_programs_argument(parser) -> None:
    parser.add_argument(
        "--max-loaded-programs",
        type=int_at_least(0),
        default=MAX_LOADED_PROGRAMS,
        metavar="N",
        help="compiled programs kept loaded at once (~5-9 MiB of memory each on SmolLM2); past N the least "
        "recently called is dropped and loaded again from the compile cache when next called, compiling "
        f"nothing. 0: all stay loaded; no bound either with the compile cache off or multi-host "
        f"(default {MAX_LOADED_PROGRAMS})",
    )


def bound_programs(engine, max_loaded: int, multi_host: bool) -> None:
    """Bound the engine's loaded executables (programs.py), and say so at start. An evicted program
    must come back from the persistent compile cache: without it, or multi-host (a follower's reload
    would stall host 0's collectives), every program stays loaded."""
    programs = base_engine(engine).programs
    if max_loaded and not multi_host and persistent_cache_on():
        programs.on_evict = release_freed_heap  # an evicted executable's pages back to the OS
        programs.bound(max_loaded)
        log.info("loaded programs: at most %d, the others reloaded from the compile cache when called", max_loaded)
        return
    why = "--max-loaded-programs 0" if not max_loaded else "multi-host" if multi_host else "the compile cache is off"
    log.info("loaded programs: all kept (%s)", why)


def add_web_argument(parser) -> None:
    parser.add_argument("--no-web", action="store_true", help="no chat page at / (it stays a 404)")


def add_parser_arguments(parser) -> None:
    """How chat replies are split: reasoning from the answer, tool calls from text."""
    parser.add_argument(
        "--reasoning-parser",
        choices=reasoning.CHOICES,
        default="auto",
        help="split <think> reasoning into reasoning_content (auto: from the chat template and vocabulary)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=tool_parsers.CHOICES,
        default="auto",
        help="the format the model writes tool calls in (auto: from the chat template; else hermes)",
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is a clear error before minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise RuntimeError(f"port {port} on {host} {reason}") from None
    sock.listen(2048)
    return sock


def _log_to_stderr() -> None:
    """hkserve's own log lines (loading, ready, draining, lost hosts) on stderr at INFO. Its own
    handler, since a library imported earlier may have configured the root logger already, which
    would make logging.basicConfig a silent no-op."""
    logger = logging.getLogger("hkserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def run_server(args: argparse.Namespace) -> int:
    _log_to_stderr()
    log.info("%s", fix_mmap_threshold())  # before loading starts JAX's threads and the compiler's scratch
    timeline = StartupTimeline()
    options = ServeOptions.from_args(args)
    hosts = HostGroup.from_flags(options.hosts)
    listener = None if hosts and hosts.host_id else bind_socket(options.host, options.port)
    if hosts:
        hosts.initialize()
    engine = load_engine(options.load, options.slots, hosts, timeline)
    if hosts and hosts.host_id:
        return run_follower(engine, hosts)
    serving = types.SimpleNamespace(app=None, runner=None)  # what a lost host must fail, once it exists
    if hosts:
        engine = _lead(engine, hosts, serving)
    runner = InferenceRunner(engine, max_queue=options.max_queue, max_step_tokens=options.max_step_tokens)
    limits = options.limits
    max_len, model = engine.max_len, options.load.model
    app = create_app(
        runner,
        ModelStore().tokenizer(model),
        model,
        max_len,
        api_key=options.api_key,
        cors_origins=options.cors_origins,
        limits=limits,
        web_page=options.web_page,
        reasoning_parser=options.reasoning_parser,
        tool_call_parser=options.tool_call_parser,
    )
    serving.app, serving.runner = app, runner
    mode = "eager" if hosts else options.compile  # multi-host: see background_compile.py
    compiles = Compiles(engine, mode, options.compile_upto)
    app.state.compiles = compiles.status
    bound_programs(engine, options.max_loaded_programs, bool(hosts))

    def warm_up():
        log.info("compiling prefill buckets and decode windows (%s) ...", compiles.mode)
        with timeline.phase("warmup"):
            compiles.before_ready()
            runner.start(warmup=False)
        released = release_freed_heap()  # what load, packing and warm-up freed leaves RSS (cli/memory.py)
        code = release_code_pages()  # the compiler's code, paged in by compiling (cli/memory.py)
        log.info(
            "returned %.0f MiB of freed heap and %.0f MiB of compiler code to the OS",
            released / 2**20,
            code / 2**20,
        )
        # The timeline before the ready line: whoever waits for "ready" finds it logged.
        log.info("startup: %s", json.dumps({**timeline.report(engine), "programs": compiles.status()}))
        log.info("ready: %s on %d slots, context %d", model, engine.slots, max_len)
        compiles.start(on_finished=finished)

    def finished():
        """The background compiles are done: what they freed, and the compiler's code they paged in, go
        back to the OS too, then the record."""
        release_freed_heap()
        release_code_pages()
        log.info("%s%s", COMPILED_LINE, json.dumps(compiled(compiles, timeline)))

    threading.Thread(target=warm_up, name="hkserve-warmup", daemon=True).start()
    config = uvicorn_config(
        app,
        limits,
        host=options.host,
        port=options.port,
        log_level="info",
        timeout_graceful_shutdown=60,
        lifespan="off",
    )
    server = DrainingServer(config, app, runner)
    # uvicorn drains on SIGTERM, then re-raises it through the previous handler: make that handler a
    # no-op so a drained shutdown exits 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[listener])
    finally:
        compiles.stop()
        runner.stop()
        if hosts:
            engine.close()
    return 0


def compiled(compiles: Compiles, timeline: StartupTimeline) -> dict:
    """The background compiles' end: its counts, and seconds from the process's start to it."""
    return {**compiles.status(), "finished_s": round(compiles.finished_at - timeline.process_start, 3)}


def _lead(engine, hosts, serving: types.SimpleNamespace):
    """Accept the other hosts on the control port; losing one fails every request, turns /health 503
    and ends this process non-zero within seconds (the engine cannot run without the lost host)."""

    def on_lost(host: int, reason: str) -> None:
        message = f"lost host {host} of {hosts.num_hosts} ({reason})"
        log.error("%s: failing all requests and exiting", message)
        if serving.app is not None:
            serving.app.state.failed = message
            serving.runner.abort(message)
            threading.Timer(2.0, exit_lost, (f"host {host}", reason)).start()  # let the errors reach clients
        else:
            exit_lost(f"host {host}", reason)

    log.info("host 0: waiting for %d other hosts on control port %d", hosts.num_hosts - 1, hosts.control_port)
    leader = Leader(hosts.control_port, hosts.num_hosts, on_lost, hosts.secret, bind=hosts.control_bind)
    return LeaderEngine(engine, leader)


def run_follower(engine, hosts) -> int:
    """A host other than 0: replay host 0's engine calls until it stops; exit non-zero if it is lost."""
    channel = Follower(
        hosts.leader_host,
        hosts.control_port,
        hosts.host_id,
        on_lost=lambda reason: exit_lost("host 0", reason),
        secret=hosts.secret,
    )
    log.info("host %d: following host 0 at %s:%d", hosts.host_id, hosts.leader_host, hosts.control_port)
    return follow(engine, channel)
