"""One generation path for the routes that take a conversation in another API's shape (Responses,
Anthropic Messages): once translated to chat messages, OpenAI-style tools and a response format, the
request goes the chat route's way (prepare.py, tools.py, Generation), one choice."""

from __future__ import annotations

from typing import Any

from hkserve.api import prepare
from hkserve.api.context import ServerContext
from hkserve.api.generation import Generation
from hkserve.api.protocol import APIError
from hkserve.api.structured import FieldError, response_format_spec
from hkserve.api.tool_parsers import model_tools
from hkserve.api.tools import Tools, render_messages
from hkserve.engine.constrained import GrammarSpec
from hkserve.model.sampling import SamplingParams


def chat_tools(
    ctx: ServerContext, tools: list[dict] | None, choice: Any, parallel: bool | None, param: str = "tools"
) -> Tools | None:
    """OpenAI chat-shaped tools as tools.py reads them, written in the model's call format
    (--tool-call-parser: ServerContext.tool_format); a 400 naming `param` when they cannot be."""
    try:
        return model_tools(ctx.tokenizer, ctx.tool_format, tools, choice, parallel)
    except FieldError as e:
        raise APIError(400, str(e), param=param if e.param == "tools" else e.param) from None


def output_grammar(response_format: dict | None, tools: Tools | None, param: str) -> tuple[GrammarSpec | None, str]:
    """What the reply must match: the response format's grammar or the tools' (not both)."""
    try:
        spec = response_format_spec(response_format)
    except FieldError as e:
        raise APIError(400, str(e).replace("response_format", param), param=param) from None
    tool_grammar = tools.grammar() if tools is not None else None
    if spec is not None and tool_grammar is not None:
        raise APIError(400, "a request constrained by tools cannot also set a response format", param=param)
    return (spec, param) if spec is not None else (tool_grammar, "tools")


async def start(
    ctx: ServerContext,
    kind: str,
    messages: list[dict],
    tools: Tools | None,
    grammar: tuple[GrammarSpec | None, str],
    max_tokens: int | None,
    sampling: SamplingParams,
    stop: list[str],
    keep: frozenset[int] = frozenset(),
) -> Generation:
    """The conversation rendered by the chat template, submitted as one choice (`keep`: the special ids
    its text shows, reply.Markers)."""
    rendered, tool_defs = render_messages(messages, tools, ctx.tokenizer.template_takes_tools)
    prompt = await ctx.off_loop(prepare.encode_chat, ctx, rendered, tool_defs)
    limits = prepare.token_limits(ctx, [prompt], max_tokens, None)
    compiled = await ctx.off_loop(prepare.compile_grammar, ctx, *grammar)
    gen = Generation(ctx.runner, ctx.tokenizer, ctx.metrics, kind, ctx.limits.max_stream_backlog)
    gen.submit([prompt], 1, limits, sampling, stop, 0, False, None, compiled, keep)
    return gen
