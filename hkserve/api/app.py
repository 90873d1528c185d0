"""OpenAI-compatible HTTP API over an InferenceRunner (or any object with its submit / cancel / stats /
ready interface — tests pass a fake one).

Every error leaves as OpenAI's error body with the right status; a client that disconnects has its
requests cancelled, so its slots free within one decode step. CPU work on a request (parsing the body,
rendering the chat template, tokenizing) runs on a few worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hkserve.api import formats, spec_metrics, web
from hkserve.api.generation import Generation, Update
from hkserve.api.guard import GuardMiddleware
from hkserve.api.limits import ServerLimits
from hkserve.api.metrics import Metrics
from hkserve.api.protocol import (
    COMPLETION_MAX_TOKENS,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    domain_error,
    parse_body,
    validation_error,
)
from hkserve.api.structured import FieldError, output_spec
from hkserve.api.tools import Tools, parse_tools, render_messages
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.constrained import Grammar, GrammarCompiler, GrammarError, GrammarSpec
from hkserve.engine.state import ContextLengthError, check_context
from hkserve.model.sampling import InvalidSampling, SamplingParams

OPEN_PATHS = {"/health", "/metrics", *web.PAGE_PATHS}  # the chat page loads without the key; its API calls send it
# A prompt of more than (context x longest token x this) characters cannot fit, whatever the tokenizer's
# normalizer merges: refused before tokenizing.
CHARS_PER_TOKEN_MARGIN = 4


def _key_matches(authorization: str, api_key: str) -> bool:
    """'Bearer KEY' (the scheme is case-insensitive, RFC 7235), compared in constant time."""
    scheme, _, given = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def create_app(
    runner,
    tokenizer: Tokenizer,
    model_name: str,
    max_len: int,
    *,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    limits: ServerLimits = ServerLimits(),
    web_page: bool = True,
) -> FastAPI:
    app = FastAPI(title="hkserve", docs_url=None, redoc_url=None)
    app.state.draining = False
    app.state.failed = None  # why the engine can no longer serve (e.g. a lost host), once it cannot
    created = int(time.time())
    metrics = Metrics(runner.stats)
    spec_metrics.register(metrics.registry, runner)
    app.state.metrics = metrics
    engine = getattr(runner, "engine", None)  # a fake runner (tests) has none: the tokenizer's vocabulary
    compiler = GrammarCompiler(tokenizer, engine.model.config.vocab_size if engine else tokenizer.vocab_size)
    if hasattr(runner, "grammars"):
        runner.grammars.observe = lambda seconds, _rows: metrics.mask_time.observe(seconds)

    # -- errors -----------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    def _guard(scope) -> None:
        """API key and readiness, before any route runs."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if (
            api_key
            and path not in OPEN_PATHS
            and scope.get("method") != "OPTIONS"
            and not _key_matches(headers.get("authorization", ""), api_key)
        ):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )
        if path.startswith("/v1/") and path != "/v1/models":
            _check_ready()

    app.add_middleware(GuardMiddleware, check=_guard, limits=limits)
    if cors_origins:  # added last = outermost, so errors from the guard carry CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])

    def _check_ready():
        if app.state.failed:
            raise APIError(503, f"the server cannot serve: {app.state.failed}", "service_unavailable")
        if app.state.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if not runner.ready.is_set():
            raise APIError(503, "the model is loading", "service_unavailable")

    def _check_model(name: str | None):
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist (this server serves `{model_name}`)",
                "not_found_error",
                "model",
                "model_not_found",
            )

    cpu = anyio.CapacityLimiter(limits.cpu_threads)

    async def _off_loop(fn, *args):
        """fn(*args) on one of the CPU threads: the event loop keeps serving meanwhile."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=cpu)

    async def _parse(request: Request, model_cls):
        return await _off_loop(parse_body, await request.body(), model_cls)

    max_prompt_chars = max_len * _longest_token(tokenizer) * CHARS_PER_TOKEN_MARGIN

    def _encode(text: str, param: str, add_bos: bool | None = None) -> list[int]:
        """Tokenize a prompt (on a CPU thread), after refusing one too long to fit at any tokenization."""
        if len(text) > max_prompt_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens; a prompt of {len(text)} characters"
                " is longer than that however it is tokenized",
                param=param,
                code="context_length_exceeded",
            )
        return tokenizer.encode(text, add_bos=add_bos)

    def _encode_chat(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            text = tokenizer.render_chat(messages, tools=tools)
        except ValueError as e:  # the template refused these messages
            raise APIError(400, str(e), param="messages") from None
        return _encode(text, "messages", add_bos=False)  # the template writes any BOS itself

    # -- plain routes -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if app.state.failed:
            return JSONResponse({"status": "failed", "error": app.state.failed}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not runner.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "hkserve",
            "max_model_len": max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        _check_model(body.model)
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await _off_loop(_encode_chat, messages)
        else:
            add_bos = None if body.add_special_tokens else False
            ids = await _off_loop(functools.partial(tokenizer.encode, body.prompt, add_bos=add_bos))
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        _check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    if web_page:
        app.include_router(web.router)

    # -- generation -------------------------------------------------------------------------------
    def _prompt_ids(prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt: text tokenized (on a CPU thread), ids checked against the vocabulary."""
        out = []
        for prompt in prompts:
            ids = _encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
            out.append(ids)
        return out

    def _check_choices(prompts: int, n: int) -> None:
        """A request needing more choices than the queue holds could never be admitted: no retry helps."""
        if prompts * n > runner.max_queue:
            raise APIError(
                400,
                f"the request needs {prompts * n} choices ({prompts} prompts x n={n}); this server queues at"
                f" most {runner.max_queue} at once",
                param="n",
            )

    def _token_limits(prompts: list[list[int]], requested: int | None, default: int | None) -> list[int]:
        """Tokens to generate per prompt: as requested, else `default` shortened to what fits (None: to
        the end of the context)."""
        out = []
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            room = max_len - len(ids)
            wanted = requested if requested is not None else max(1, min(room, default or room))
            try:
                check_context(max_len, len(ids), wanted)
            except ContextLengthError as e:
                raise domain_error(e) from e
            out.append(wanted)
        return out

    def _sampling(body: SamplingFields) -> SamplingParams:
        """The body's sampling settings; a request without a seed gets a random one."""
        try:
            sampling = body.sampling(int.from_bytes(os.urandom(4), "little"))
            sampling.check_vocab(tokenizer.vocab_size)
        except InvalidSampling as e:
            raise domain_error(e) from e
        return sampling

    def _compile(spec: GrammarSpec | None, param: str) -> Grammar | None:
        """The request's grammar compiled (on a CPU thread); one llguidance refuses is a 400 naming why."""
        if spec is None:
            return None
        try:
            return compiler.compile(spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param) from None

    def _structure(body: SamplingFields, tools: Tools | None = None) -> tuple[GrammarSpec | None, str]:
        """What the output must match (response_format, structured_outputs or tools) and its field."""
        try:
            spec = output_spec(body.response_format, body.structured_outputs)
        except FieldError as e:
            raise APIError(400, str(e), param=e.param) from None
        tool_grammar = tools.grammar() if tools is not None else None
        if spec is not None and tool_grammar is not None:
            raise APIError(400, "a request constrained by tools cannot also set a response format", param="tools")
        return (spec, "response_format") if spec is not None else (tool_grammar, "tools")

    async def _run(request: Request, gen: Generation, stream: bool, render_chunk, render_final):
        if stream:
            return StreamingResponse(
                _sse(request, gen, render_chunk),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = asyncio.create_task(_collect(gen))
        watch = asyncio.create_task(_watch_disconnect(request))
        done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client left: its choices were cancelled
            gen.cancel()
            collect.cancel()
            return Response(status_code=499)
        watch.cancel()
        return JSONResponse(render_final(gen, collect.result()))

    async def _collect(gen: Generation) -> list[list[Update]]:
        per_choice: list[list[Update]] = [[] for _ in gen.choices]
        async for update in gen.updates():
            per_choice[update.choice.index].append(update)
        return per_choice

    async def _watch_disconnect(request: Request):
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    async def _sse(request: Request, gen: Generation, render_chunk):
        try:
            for head in render_chunk(gen, None):
                yield f"data: {json.dumps(head)}\n\n"
            async for update in gen.updates():
                for chunk in render_chunk(gen, update):
                    yield f"data: {json.dumps(chunk)}\n\n"
            for tail in render_chunk(gen, "usage"):
                yield f"data: {json.dumps(tail)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            gen.cancel()  # a disconnect ends this generator early: free the slots
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        sampling = _sampling(body)
        _check_model(body.model)
        _check_choices(len(body.prompts()), body.n)
        prompts = await _off_loop(_prompt_ids, body.prompts())
        max_tokens = _token_limits(prompts, body.max_tokens, COMPLETION_MAX_TOKENS)
        grammar = await _off_loop(_compile, *_structure(body))
        gen = Generation(runner, tokenizer, metrics, "completion", limits.max_stream_backlog)
        logprobs = body.logprobs or 0
        scoring = body.prompt_scoring()
        gen.submit(prompts, body.n, max_tokens, sampling, body.stop, logprobs, body.ignore_eos, scoring, grammar)
        echo = [tokenizer.decode(p) for p in prompts] if body.echo else None
        fmt = formats.CompletionFormat(tokenizer, model_name, body, echo)
        return await _run(request, gen, body.stream, fmt.chunks, fmt.final)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest)
        sampling = _sampling(body)
        _check_model(body.model)
        _check_choices(1, body.n)
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except FieldError as e:
            raise APIError(400, str(e), param=e.param) from None
        messages, tool_defs = render_messages(body.template_messages(), tools, tokenizer.template_takes_tools)
        prompt = await _off_loop(_encode_chat, messages, tool_defs)
        max_tokens = _token_limits([prompt], body.token_limit, None)
        grammar = await _off_loop(_compile, *_structure(body, tools))
        gen = Generation(runner, tokenizer, metrics, "chat", limits.max_stream_backlog)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        gen.submit([prompt], body.n, max_tokens, sampling, body.stop, top, body.ignore_eos, None, grammar)
        fmt = formats.ChatFormat(tokenizer, model_name, body, tools)
        return await _run(request, gen, body.stream, fmt.chunks, fmt.final)

    return app


def _longest_token(tokenizer: Tokenizer) -> int:
    """Characters in the longest token: no tokenization of a text has fewer tokens than its length / this."""
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
