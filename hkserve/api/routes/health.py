"""GET /health (200 "ok" only when generations are taken: else 503 loading / draining / failed; "ok" also
reports the programs compiled and still pending under `hkserve serve`, and with the paged KV layout the
pool) and GET /metrics (Prometheus text). Both are open without the API key (access.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from hkserve.api.context import Context, not_ready

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    why = not_ready(request.app.state)
    if why == "failed":
        return JSONResponse({"status": "failed", "error": request.app.state.failed}, status_code=503)
    if why is not None:
        return JSONResponse({"status": why}, status_code=503)
    stats = request.app.state.context.runner.stats()
    compiles = request.app.state.compiles
    status = {"status": "ok", **({"programs": compiles()} if compiles is not None else {})}
    if not stats.kv_blocks_total:
        return status
    pool = {
        "blocks_total": stats.kv_blocks_total,
        "blocks_used": stats.kv_blocks_used,
        "blocks_cached": stats.kv_blocks_cached,  # no slot names them: evicted when blocks are needed
        "blocks_free": stats.kv_blocks_total - stats.kv_blocks_used - stats.kv_blocks_cached,
        "block_size": stats.kv_block_size,
        "preemptions": stats.preemptions,
    }
    return {**status, "kv_pool": pool}


@router.get("/metrics")
async def prometheus(ctx: Context):
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
