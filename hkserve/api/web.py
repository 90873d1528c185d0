"""The chat page at `/`: static HTML/CSS/JS shipped in the package (hkserve/api/web/), no build step and
no CDN, so it works offline. It only talks to this server's own OpenAI routes; being static, it loads
without the API key (the key is typed into the page and sent as a Bearer header on its API calls).

The files are read once, when the router is built: a request never touches the disk.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

ASSETS = {  # file in hkserve/api/web/ -> media type
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
}
# What the page itself fetches before a key is known: open past the API-key check (access.py's OPEN_PATHS).
PAGE_PATHS = frozenset({"/"} | {f"/web/{name}" for name in ASSETS if name != "index.html"})
HEADERS = {
    "Cache-Control": "no-cache",
    # Only this server's own files and API; no inline script, so injected markup could not run either.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
}


def _build() -> APIRouter:
    folder = resources.files("hkserve.api") / "web"
    files = {name: (folder / name).read_bytes() for name in ASSETS}
    router = APIRouter(include_in_schema=False)

    def route(path: str, name: str) -> None:
        body, media_type = files[name], ASSETS[name]

        async def serve() -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        router.add_api_route(path, serve, methods=["GET"], name=f"web:{name}")

    route("/", "index.html")
    for name in ASSETS:
        if name != "index.html":
            route(f"/web/{name}", name)
    return router


router = _build()
