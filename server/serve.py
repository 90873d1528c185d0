"""`hkserve serve`: load a model, answer /health with 503 while warming up, serve with uvicorn, drain
on SIGTERM (stop admitting, let running requests finish, then stop the engine)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import uvicorn

from server.api import create_app

log = logging.getLogger("hkserve.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, but a shutdown signal first turns /health to 503 and refuses new generations."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.hk_app = app

    def handle_exit(self, sig, frame):
        self.hk_app.state.draining = True
        super().handle_exit(sig, frame)


def run_server(args) -> int:
    from server.cli import load_runner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("HKSERVE_API_KEY") or None
    tokenizer, runner, max_len = load_runner(args, slots=args.slots, start=False, max_queue=args.max_queue)
    app = create_app(runner, tokenizer, args.model, max_len, api_key=api_key, cors_origins=tuple(args.cors_origin or ()))

    def warm_up():
        log.info("compiling prefill buckets and decode windows ...")
        runner.start(warmup=True)
        log.info("ready: %s on %d slots, context %d", args.model, runner.engine.slots, max_len)

    threading.Thread(target=warm_up, name="hkserve-warmup", daemon=True).start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=60,
                            lifespan="off")
    server = DrainingServer(config, app)
    # uvicorn drains on SIGTERM, then re-raises it through the previous handler: make that handler a
    # no-op so a drained shutdown exits 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        runner.stop()
    return 0
