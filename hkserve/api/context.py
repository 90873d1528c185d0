"""What every route shares, as one typed record in `app.state.context`: the runner and tokenizer, the
served model's name and context, the limits, the metrics, the grammar compiler and the CPU threads.

The two flags a server's life changes (`app.state.draining` on SIGTERM, `app.state.failed` on a lost
host) stay on `app.state`, where cli/serve.py sets them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import Depends, Request

from hkserve.api.limits import ServerLimits
from hkserve.api.metrics import Metrics
from hkserve.api.protocol import APIError
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.constrained import GrammarCompiler
from hkserve.engine.protocols import ServingRunner

# A prompt of more than (context x longest token x this) characters cannot fit, whatever the tokenizer's
# normalizer merges: refused before tokenizing.
CHARS_PER_TOKEN_MARGIN = 4


@dataclass(frozen=True)
class ServerContext:
    runner: ServingRunner
    tokenizer: Tokenizer
    model_name: str
    max_len: int  # tokens of context a request may use
    limits: ServerLimits
    metrics: Metrics
    compiler: GrammarCompiler  # response formats, structured outputs and tools → token masks
    cpu: anyio.CapacityLimiter  # the threads that parse, render chat templates and tokenize
    created: int  # unix time the server started (the model card's `created`)
    max_prompt_chars: int  # longer prompts cannot fit at any tokenization (CHARS_PER_TOKEN_MARGIN)
    reasoning_parser: str | None = None  # reasoning.PARSERS, or None: all the output is content
    tool_format: str = "hermes"  # tool_parsers.FORMATS: how the model writes tool calls

    async def off_loop(self, fn, *args):
        """fn(*args) on one of the CPU threads: the event loop keeps serving meanwhile."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.cpu)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                "not_found_error",
                "model",
                "model_not_found",
            )


def server_context(request: Request) -> ServerContext:
    """The app's ServerContext (a FastAPI dependency)."""
    return request.app.state.context


Context = Annotated[ServerContext, Depends(server_context)]  # a route's parameter type


def not_ready(state) -> str | None:
    """Why the server cannot take a generation now (`state`: the app's), or None when it can."""
    if state.failed:
        return "failed"
    if state.draining:
        return "draining"
    if not state.context.runner.ready.is_set():
        return "loading"
    return None


def check_ready(state) -> None:
    """A 503 naming why, unless the server can take a generation now."""
    why = not_ready(state)
    if why == "failed":
        raise APIError(503, f"the server cannot serve: {state.failed}", "service_unavailable")
    if why == "draining":
        raise APIError(503, "the server is shutting down", "service_unavailable")
    if why == "loading":
        raise APIError(503, "the model is loading", "service_unavailable")


def longest_token(tokenizer: Tokenizer) -> int:
    """Characters in the longest token: no tokenization of a text has fewer tokens than its length / this."""
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
