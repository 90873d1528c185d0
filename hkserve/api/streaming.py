"""A submitted Generation as the HTTP response: server-sent events as the tokens come (`stream`), or
one JSON body once every choice finished. Either way a client that disconnects has its choices
cancelled, so their slots free within one decode step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hkserve.api.generation import Generation, Update
from hkserve.api.protocol import APIError

DISCONNECT_POLL_S = 0.05  # how often a whole-body response checks whether its client is still there


async def respond(request: Request, gen: Generation, stream: bool, render_chunk: Callable, render_final: Callable):
    """The response to a submitted generation: an SSE stream of `render_chunk`'s chunks, or
    `render_final`'s body (499 when the client left first)."""
    if stream:
        return StreamingResponse(
            sse(gen, render_chunk),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collect = asyncio.create_task(collect_updates(gen))
    watch = asyncio.create_task(_watch_disconnect(request))
    done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:  # the client left: its choices were cancelled
        gen.cancel()
        collect.cancel()
        return Response(status_code=499)
    watch.cancel()
    return JSONResponse(render_final(gen, collect.result()))


async def collect_updates(gen: Generation) -> list[list[Update]]:
    """Every update of the generation, per choice."""
    per_choice: list[list[Update]] = [[] for _ in gen.choices]
    async for update in gen.updates():
        per_choice[update.choice.index].append(update)
    return per_choice


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def sse(gen: Generation, render_chunk: Callable) -> AsyncIterator[str]:
    """`render_chunk(gen, None)` (the head), one per update, then `render_chunk(gen, "usage")`, as SSE
    events; an error mid-stream as its OpenAI body; always "[DONE]" last."""
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
