"""POST /v1/messages: Anthropic's Messages API, through the chat route's generation path
(conversation.py): system, text / tool_use / tool_result blocks, tools, stop_sequences. Its errors
leave in Anthropic's error body (anthropic_errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hkserve.api import conversation, prepare
from hkserve.api.anthropic_format import MessagesFormat
from hkserve.api.anthropic_request import MessagesRequest
from hkserve.api.context import Context
from hkserve.api.reply import Markers
from hkserve.api.streaming import Framing, respond

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request, ctx: Context):
    body, sampling = await prepare.parse_generation(ctx, request, MessagesRequest)
    choice, parallel = body.chat_tool_choice()
    tools = conversation.chat_tools(ctx, body.chat_tools(), choice, parallel)
    grammar = conversation.output_grammar(None, tools, "tools")
    messages_, stop = body.chat_messages(), body.stop_sequences or []
    markers = Markers.of(ctx.tokenizer, tools)
    gen = await conversation.start(
        ctx, "message", messages_, tools, grammar, body.max_tokens, sampling, stop, markers.ids
    )
    fmt = MessagesFormat(ctx.model_name, tools, markers)
    return await respond(request, gen, body.stream, fmt.chunks, fmt.final, Framing(True, fmt.error))
