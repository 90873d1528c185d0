"""GET /v1/models (the one model served), and vLLM's POST /tokenize and /detokenize."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request

from hkserve.api import prepare
from hkserve.api.context import Context
from hkserve.api.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.get("/v1/models")
async def models(ctx: Context):
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "hkserve",
        "max_model_len": ctx.max_len,
    }
    return {"object": "list", "data": [card]}


@router.post("/tokenize")
async def tokenize(request: Request, ctx: Context):
    body = await prepare.parse(ctx, request, TokenizeRequest)
    ctx.check_model(body.model)
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await ctx.off_loop(prepare.encode_chat, ctx, messages)
    else:
        add_bos = None if body.add_special_tokens else False
        ids = await ctx.off_loop(functools.partial(ctx.tokenizer.encode, body.prompt, add_bos=add_bos))
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_len}


@router.post("/detokenize")
async def detokenize(request: Request, ctx: Context):
    body = await prepare.parse(ctx, request, DetokenizeRequest)
    ctx.check_model(body.model)
    prepare.check_vocab(ctx, body.tokens, "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
