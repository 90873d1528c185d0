"""POST /v1/completions: one or more prompts (text or token ids), n choices each, streamed or whole."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hkserve.api import formats, prepare
from hkserve.api.context import Context
from hkserve.api.generation import Generation
from hkserve.api.protocol import COMPLETION_MAX_TOKENS, CompletionRequest
from hkserve.api.streaming import respond

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, ctx: Context):
    body, sampling = await prepare.parse_generation(ctx, request, CompletionRequest)
    prepare.check_choices(ctx, len(body.prompts()), body.n)
    prompts = await ctx.off_loop(prepare.prompt_ids, ctx, body.prompts())
    returns_prompt = body.echo or body.prompt_logprobs is not None  # max_tokens 0 is then allowed
    max_tokens = prepare.token_limits(ctx, prompts, body.max_tokens, COMPLETION_MAX_TOKENS, returns_prompt)
    scoring = body.prompt_scoring()
    grammar = await ctx.off_loop(prepare.compile_grammar, ctx, *prepare.structure(body))
    gen = Generation(ctx.runner, ctx.tokenizer, ctx.metrics, "completion", ctx.limits.max_stream_backlog)
    logprobs = body.logprobs or 0
    gen.submit(prompts, body.n, max_tokens, sampling, body.stop, logprobs, body.ignore_eos, scoring, grammar)
    echo = [ctx.tokenizer.decode(p) for p in prompts] if body.echo else None
    fmt = formats.CompletionFormat(ctx.tokenizer, ctx.model_name, body, echo)
    return await respond(request, gen, body.stream, fmt.chunks, fmt.final)
