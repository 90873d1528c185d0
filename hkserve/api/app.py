"""OpenAI-compatible HTTP API over a ServingRunner (engine/protocols.py: InferenceRunner, or tests'
fake one): `create_app` wires the shared ServerContext, the guard, the error handlers and the routes.

Every error leaves as OpenAI's error body with the right status (errors.py); a client that
disconnects has its requests cancelled, so its slots free within one decode step (streaming.py). CPU
work on a request (parsing the body, rendering the chat template, tokenizing) runs on a few worker
threads, never on the event loop (ServerContext.off_loop).
"""

from __future__ import annotations

import time

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from hkserve.api import reasoning, spec_metrics, tool_parsers, web
from hkserve.api.access import access_check
from hkserve.api.context import CHARS_PER_TOKEN_MARGIN, ServerContext, longest_token
from hkserve.api.errors import install_error_handlers
from hkserve.api.guard import GuardMiddleware
from hkserve.api.limits import ServerLimits
from hkserve.api.metrics import Metrics
from hkserve.api.response_store import ResponseStore
from hkserve.api.routes import chat, completions, health, messages, models, responses
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.constrained import GrammarCompiler
from hkserve.engine.protocols import ServingRunner


def create_app(
    runner: ServingRunner,
    tokenizer: Tokenizer,
    model_name: str,
    max_len: int,
    *,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    limits: ServerLimits = ServerLimits(),
    web_page: bool = True,
    reasoning_parser: str = "auto",
    tool_call_parser: str = "auto",
) -> FastAPI:
    """The app; `reasoning_parser` and `tool_call_parser` are the --reasoning-parser and
    --tool-call-parser choices ("auto": from the chat template and vocabulary)."""
    app = FastAPI(title="hkserve", docs_url=None, redoc_url=None)
    app.state.draining = False
    app.state.compiles = None  # () -> the programs compiled / pending (hkserve serve's; /health reports it)
    app.state.failed = None  # why the engine can no longer serve (e.g. a lost host), once it cannot
    app.state.response_store = ResponseStore()  # /v1/responses' previous_response_id
    metrics = Metrics(runner.stats)
    spec_metrics.register(metrics.registry, runner)
    runner.observe_masks(lambda seconds, _rows: metrics.mask_time.observe(seconds))
    app.state.context = ServerContext(
        runner,
        tokenizer,
        model_name,
        max_len,
        limits,
        metrics,
        GrammarCompiler(tokenizer, runner.vocab_size or tokenizer.vocab_size),
        anyio.CapacityLimiter(limits.cpu_threads),
        created=int(time.time()),
        max_prompt_chars=max_len * longest_token(tokenizer) * CHARS_PER_TOKEN_MARGIN,
        reasoning_parser=reasoning.choose(
            reasoning_parser, tokenizer.chat_template, tokenizer.has_token(reasoning.START)
        ),
        tool_format=tool_parsers.choose(tool_call_parser, tokenizer.chat_template),
    )
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, check=access_check(app.state, api_key), limits=limits)
    if cors_origins:  # added last = outermost, so errors from the guard carry CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])
    for routes in (health, models, completions, chat, responses, messages):
        app.include_router(routes.router)
    if web_page:  # the chat page at / (--no-web: / is a 404)
        app.include_router(web.router)
    return app
