"""POST /v1/chat/completions: messages through the model's chat template, with tools and response
formats as grammars, n choices, streamed or whole."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hkserve.api import formats, prepare
from hkserve.api.context import Context
from hkserve.api.generation import Generation
from hkserve.api.protocol import APIError, ChatRequest
from hkserve.api.streaming import respond
from hkserve.api.structured import FieldError
from hkserve.api.tool_parsers import model_tools
from hkserve.api.tools import render_messages

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(request: Request, ctx: Context):
    body, sampling = await prepare.parse_generation(ctx, request, ChatRequest)
    prepare.check_choices(ctx, 1, body.n)
    try:
        tools = model_tools(ctx.tokenizer, ctx.tool_format, body.tools, body.tool_choice, body.parallel_tool_calls)
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    messages, tool_defs = render_messages(body.template_messages(), tools, ctx.tokenizer.template_takes_tools)
    prompt = await ctx.off_loop(prepare.encode_chat, ctx, messages, tool_defs, body.chat_template_kwargs)
    max_tokens = prepare.token_limits(ctx, [prompt], body.token_limit, None)
    grammar = await ctx.off_loop(prepare.compile_grammar, ctx, *prepare.structure(body, tools, ctx.reasoning_parser))
    fmt = formats.ChatFormat(ctx.tokenizer, ctx.model_name, body, tools, ctx.reasoning_parser)
    gen = Generation(ctx.runner, ctx.tokenizer, ctx.metrics, "chat", ctx.limits.max_stream_backlog)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    stop, ignore_eos, keep = body.stop, body.ignore_eos, fmt.markers.ids
    gen.submit([prompt], body.n, max_tokens, sampling, stop, top, ignore_eos, None, grammar, keep)
    return await respond(request, gen, body.stream, fmt.chunks, fmt.final)
