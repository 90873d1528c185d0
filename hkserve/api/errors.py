"""Every error leaves as OpenAI's error body with its status (Anthropic's on the Messages route,
anthropic_errors.py): ours (APIError), a body FastAPI could not validate (400), and Starlette's own
(404 for an unknown path, 405, ...)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hkserve.api.anthropic_errors import error_body
from hkserve.api.protocol import APIError, validation_error


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(error_body(request.url.path, exc), status_code=exc.status, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError):
    return JSONResponse(error_body(request.url.path, validation_error(exc)), status_code=400)


async def _http(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, str(exc.detail), kind)
    return JSONResponse(error_body(request.url.path, error), status_code=exc.status_code)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
