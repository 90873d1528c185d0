"""A submitted Generation as the HTTP response: server-sent events as the tokens come (`stream`), or
one JSON body once every choice finished. Either way a client that disconnects has its choices
cancelled, so their slots free within one decode step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hkserve.api.generation import Generation, Update
from hkserve.api.protocol import APIError

DISCONNECT_POLL_S = 0.05  # how often a whole-body response checks whether its client is still there


class Framing(NamedTuple):
    """How a stream writes its events: OpenAI's chat and completions send `data:` lines and "[DONE]"
    last; the Responses and Anthropic Messages APIs send typed events (`event: <type>`, no "[DONE]"),
    an error as their own event (`error`: the APIError as a body whose type is "error")."""

    typed: bool = False
    error: Callable[[APIError], dict] = APIError.body

    def event(self, chunk: dict) -> str:
        head = f"event: {chunk['type']}\n" if self.typed else ""
        return f"{head}data: {json.dumps(chunk)}\n\n"


OPENAI_SSE = Framing()


async def respond(
    request: Request,
    gen: Generation,
    stream: bool,
    render_chunk: Callable,
    render_final: Callable,
    framing: Framing = OPENAI_SSE,
):
    """The response to a submitted generation: an SSE stream of `render_chunk`'s chunks, or
    `render_final`'s body (499 when the client left first)."""
    if stream:
        return StreamingResponse(
            sse(gen, render_chunk, framing),
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


async def sse(gen: Generation, render_chunk: Callable, framing: Framing = OPENAI_SSE) -> AsyncIterator[str]:
    """`render_chunk(gen, None)` (the head), one per update, then `render_chunk(gen, "usage")`, as SSE
    events; an error mid-stream as `framing.error`'s body; "[DONE]" last unless the events are typed."""
    try:
        for head in render_chunk(gen, None):
            yield framing.event(head)
        async for update in gen.updates():
            for chunk in render_chunk(gen, update):
                yield framing.event(chunk)
        for tail in render_chunk(gen, "usage"):
            yield framing.event(tail)
    except APIError as e:
        yield framing.event(framing.error(e))
    finally:
        gen.cancel()  # a disconnect ends this generator early: free the slots
    if not framing.typed:
        yield "data: [DONE]\n\n"
