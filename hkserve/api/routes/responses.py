"""POST /v1/responses: OpenAI's Responses API, through the chat route's generation path
(conversation.py): input items, instructions, function tools, text.format, previous_response_id."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hkserve.api import conversation, prepare
from hkserve.api.context import Context
from hkserve.api.reply import Markers
from hkserve.api.responses_format import ResponsesFormat
from hkserve.api.responses_request import ResponsesRequest, input_messages
from hkserve.api.streaming import Framing, respond

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request, ctx: Context):
    body, sampling = await prepare.parse_generation(ctx, request, ResponsesRequest)
    store = request.app.state.response_store
    history = store.get(body.previous_response_id) if body.previous_response_id else []
    conversation_ = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation_
    tools = conversation.chat_tools(ctx, body.chat_tools(), body.chat_tool_choice(), body.parallel_tool_calls)
    grammar = conversation.output_grammar(body.response_format(), tools, "text")
    markers = Markers.of(ctx.tokenizer, tools)
    limit = body.max_output_tokens
    gen = await conversation.start(ctx, "response", messages, tools, grammar, limit, sampling, [], markers.ids)
    fmt = ResponsesFormat(ctx.model_name, body, tools, store, conversation_, markers)
    return await respond(request, gen, body.stream, fmt.chunks, fmt.final, Framing(True, fmt.error))
