"""Preparing a generation request before anything is submitted: its prompts as token ids, how many
tokens each may generate, its sampling settings and the grammar its output must match. Each check
raises an APIError 400 naming the field; nothing here touches the runner but its queue bound.

The slow parts (tokenizing, rendering a chat template, compiling a grammar) are plain functions the
routes run on a CPU thread (ServerContext.off_loop)."""

from __future__ import annotations

import os

from fastapi import Request
from pydantic import BaseModel

from hkserve.api.context import ServerContext
from hkserve.api.protocol import APIError, SamplingFields, domain_error, parse_body
from hkserve.api.reasoning import answer_only
from hkserve.api.structured import FieldError, output_spec
from hkserve.api.tools import Tools
from hkserve.engine.constrained import Grammar, GrammarError, GrammarSpec
from hkserve.engine.state import ContextLengthError, check_context, check_max_tokens
from hkserve.model.sampling import InvalidSampling, SamplingParams

TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}


async def parse(ctx: ServerContext, request: Request, model_cls: type[BaseModel]):
    """The request's JSON body as `model_cls` (parsed on a CPU thread)."""
    return await ctx.off_loop(parse_body, await request.body(), model_cls)


async def parse_generation(ctx: ServerContext, request: Request, model_cls: type[SamplingFields]):
    """A generation request's body and its sampling settings, for the model this server serves."""
    body = await parse(ctx, request, model_cls)
    params = sampling(ctx, body)
    ctx.check_model(body.model)
    return body, params


def encode(ctx: ServerContext, text: str, param: str, add_bos: bool | None = None) -> list[int]:
    """Tokenize a prompt, after refusing one too long to fit at any tokenization."""
    if len(text) > ctx.max_prompt_chars:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx.max_len} tokens; a prompt of {len(text)} characters"
            " is longer than that however it is tokenized",
            param=param,
            code="context_length_exceeded",
        )
    return ctx.tokenizer.encode(text, add_bos=add_bos)


def encode_chat(
    ctx: ServerContext, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None
) -> list[int]:
    """The messages through the model's chat template (with the request's chat_template_kwargs as
    `variables`), tokenized."""
    reserved = sorted(set(variables or ()) & TEMPLATE_OWN)
    if reserved:
        raise APIError(400, f"chat_template_kwargs must not set {', '.join(reserved)}", param="chat_template_kwargs")
    try:
        text = ctx.tokenizer.render_chat(messages, tools=tools, variables=variables)
    except ValueError as e:  # the template refused these messages
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # only a client's variable can break a template that renders without them
        if not variables:
            raise
        message = f"the chat template failed with these chat_template_kwargs: {type(e).__name__}: {e}"
        raise APIError(400, message, param="chat_template_kwargs") from None
    return encode(ctx, text, "messages", add_bos=False)  # the template writes any BOS itself


def check_vocab(ctx: ServerContext, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < ctx.tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param=param)


def prompt_ids(ctx: ServerContext, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt: text tokenized, ids checked against the vocabulary."""
    out = []
    for prompt in prompts:
        ids = encode(ctx, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        check_vocab(ctx, ids, "prompt")
        out.append(ids)
    return out


def check_choices(ctx: ServerContext, prompts: int, n: int) -> None:
    """A request needing more choices than the queue holds could never be admitted: no retry helps."""
    if prompts * n > ctx.runner.max_queue:
        raise APIError(
            400,
            f"the request needs {prompts * n} choices ({prompts} prompts x n={n}); this server queues at"
            f" most {ctx.runner.max_queue} at once",
            param="n",
        )


def token_limits(
    ctx: ServerContext, prompts: list[list[int]], requested: int | None, default: int | None, scoring: bool = False
) -> list[int]:
    """Tokens to generate per prompt: as requested (0 only when `scoring`: the prompt comes back), else
    `default` shortened to what fits (None: to the end of the context). A requested max_tokens goes
    through the engine's own checks (check_max_tokens, check_context), here as in the runner: a 400
    that names the field, whatever the runner."""
    if requested is not None:
        try:
            check_max_tokens(requested, scoring)
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens") from None
    out = []
    for ids in prompts:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = ctx.max_len - len(ids)
        wanted = requested if requested is not None else max(1, min(room, default or room))
        try:
            check_context(ctx.max_len, len(ids), wanted)
        except ContextLengthError as e:
            raise domain_error(e) from e
        out.append(wanted)
    return out


def sampling(ctx: ServerContext, body: SamplingFields) -> SamplingParams:
    """The body's sampling settings; a request without a seed gets a random one."""
    try:
        params = body.sampling(int.from_bytes(os.urandom(4), "little"))
        params.check_vocab(ctx.tokenizer.vocab_size)
    except InvalidSampling as e:
        raise domain_error(e) from e
    return params


def structure(
    body: SamplingFields, tools: Tools | None = None, reasoning: str | None = None
) -> tuple[GrammarSpec | None, str]:
    """What the output must match (response_format, structured_outputs or tools) and its field; with
    a reasoning parser, what the answer after the reasoning must match."""
    try:
        spec = output_spec(body.response_format, body.structured_outputs)
        tool_grammar = tools.grammar() if tools is not None else None
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    if spec is not None and tool_grammar is not None:
        raise APIError(400, "a request constrained by tools cannot also set a response format", param="tools")
    spec, param = (spec, "response_format") if spec is not None else (tool_grammar, "tools")
    try:
        return answer_only(spec, reasoning), param
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from None


def compile_grammar(ctx: ServerContext, spec: GrammarSpec | None, param: str) -> Grammar | None:
    """The request's grammar compiled; one llguidance refuses is a 400 naming why."""
    if spec is None:
        return None
    try:
        return ctx.compiler.compile(spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from None
