"""When a server's programs compile, around /health turning ready (`hkserve serve --compile MODE`):

  * "eager": every program before ready (a start pays for long prompts and scoring it may never see);
  * "background" (the default): the common programs (warmup.COMMON_CONTEXT) before ready, the rare
    rest (scoring at any context among them) after it on one thread, smallest context first;
  * "lazy": the common programs before ready, each rare one when a request first needs it.

Whatever the mode, a request never fails on a program not compiled yet: the engine's program table
(programs.py) compiles it on the spot, or waits for the background thread's compile of it when that
is under way, so no program compiles twice. The background thread compiles ahead of time on abstract
arguments: it never runs a program, never touches the live decode state the runner's loop owns.

Multi-host serving stays eager (cli/serve.py): a follower compiles a program only when host 0's call
reaches it, so a background compile on host 0 alone would leave the other hosts compiling it inside a
collective host 0 has already entered, its timeout counting their compile; compiling every program on
every host before ready keeps them in step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hkserve.engine.forwarding import base_engine
from hkserve.engine.warmup import COMMON_CONTEXT, ProgramCall

MODES = ("eager", "background", "lazy")
COMPILED_LINE = "compiled: "  # the server's log line once no program is left to compile (bench/startup.py)

log = logging.getLogger("hkserve.compile")


class Compiles:
    """One engine's compiles around ready (see the module docstring), and their counts for /health."""

    def __init__(self, engine, mode: str = "background", upto: int = COMMON_CONTEXT):
        """`engine`: the served one (wrappers too: the rare programs are its base Engine's); `upto`: the
        cut, the longest context whose programs compile before ready."""
        if mode not in MODES:
            raise ValueError(f"compile mode {mode!r} is not one of {', '.join(MODES)}")
        self.engine, self.mode, self.upto = engine, mode, upto
        self._programs = base_engine(engine).programs
        self._lock = threading.Lock()
        self._pending: list[ProgramCall] = []  # the background thread's, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.finished = threading.Event()  # set once nothing is left for the background thread
        self.finished_at: float | None = None  # time.time() then

    def before_ready(self) -> None:
        """Compile what ready waits for: every program (eager), the common ones (else)."""
        if self.mode == "eager":
            self.engine.warmup()  # a LeaderEngine's takes no cut
        else:
            self.engine.warmup(self.upto)
        if self.mode != "lazy":
            with self._lock:
                self._pending = self._rare_calls(None if self.mode == "eager" else self.upto)
        if self.mode == "eager":  # the programs no cut lets warmup() compile (scoring): now, before ready
            self.run_pending()

    def _rare_calls(self, upto: int | None) -> list[ProgramCall]:
        """What `warmup(upto)` left out (a speculating engine's own programs too). A LeaderEngine has no
        such list: its warmup compiles what it does on every host before ready (background_compile's
        docstring), and what it leaves out (scoring) every host compiles when a request first needs it."""
        rare_calls = getattr(self.engine, "rare_calls", None)
        return rare_calls(upto) if rare_calls is not None else []

    def start(self, on_finished: Callable[[], None] | None = None) -> None:
        """After ready: compile the pending programs on a thread (background mode; in the others nothing
        is pending and `on_finished` is called now)."""

        def run():
            self.run_pending()
            if on_finished is not None and self.finished.is_set():
                on_finished()

        self._thread = threading.Thread(target=run, name="hkserve-compile", daemon=True)
        self._thread.start()

    def run_pending(self, limit: int | None = None) -> None:
        """Compile the pending programs in order, at most `limit` of them (None: all), on the calling
        thread (the background thread's body; tests call it to drive the progress themselves). One the
        runner compiled first is not compiled again (the table has it); one that fails is logged and
        dropped: a request that needs it compiles it then, and meets the error itself."""
        done = 0
        while not self._stop.is_set() and (limit is None or done < limit):
            with self._lock:
                if not self._pending:
                    break
                call = self._pending[0]
            try:
                call.compile()
            except Exception:
                log.exception("background compile of a %d-token program failed", call.context)
            with self._lock:
                self._pending.pop(0)
            done += 1
        with self._lock:
            if not self._pending and not self.finished.is_set():
                self.finished_at = time.time()
                self.finished.set()

    def stop(self) -> None:
        """No more background compiles; returns once the one under way has finished. A serve that
        returned while the daemon thread was still inside XLA's compiler died by SIGABRT as the
        interpreter shut down beneath it (test_serve's SIGTERM test, once in a fresh-clone run)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def status(self) -> dict:
        """{"mode", "compiled": programs in the engine's table, "pending": left for the background thread,
        and the table's loaded executables, their bound, evictions and reloads (programs.py)}."""
        with self._lock:
            pending = len(self._pending)
        return {"mode": self.mode, "compiled": len(self._programs), "pending": pending, **self._programs.status()}
