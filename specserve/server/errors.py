"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, on every route.

Handlers raise `APIError`; `install_error_handlers` turns it, FastAPI's own validation errors, unknown routes
and wrong methods into that shape, so no client ever sees FastAPI's 422 format.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer (never sent: it is gone)


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ClientLeft(Exception):
    """The client closed the connection before its request's body had arrived (answered 499, logged at info)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        # A message may quote client text; lone surrogates in it could not be encoded into the response.
        self.message = _encodable(message)
        self.param = None if param is None else _encodable(param)
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unavailable(message: str) -> APIError:
    return APIError(503, message)


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """One readable message from pydantic's error list (the first bad field; union branches folded)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = loc[0] if loc else None
    if first.get("type") == "missing":
        return bad_request(f"missing required field {'.'.join(loc)!r}", param=field)
    same = [x for x in errors if [str(y) for y in x.get("loc", ()) if y != "body"][:1] == loc[:1]]
    if len(same) > 1 and field is not None:
        # A union field (e.g. prompt: str | list[int] | ...) reports one error per branch.
        kinds = sorted({_describe(x) for x in same})
        return bad_request(f"{field!r} has the wrong type or value: {'; or '.join(kinds)}", param=field)
    where = ".".join(loc)
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid"),
                       param=field)


def _describe(err: dict) -> str:
    loc = [str(x) for x in err.get("loc", ())]
    return f"{err.get('msg', 'invalid')} ({'.'.join(loc[1:])})" if len(loc) > 1 else err.get("msg", "invalid")


def client_left(path: str, what: str) -> Response:
    """The answer to a request whose client went away: an abort, not an error (logged once, at info level)."""
    logger.info("%s: the client went away %s", path, what)
    return Response(status_code=CLIENT_CLOSED)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """on_error(status) is called for every error answer (metrics). An unexpected exception is logged with its
    traceback and answered with a 500 that names no internals (the log has them, under the same error id)."""

    def answer(err: APIError) -> JSONResponse:
        on_error(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return answer(APIError(404, f"no such endpoint: {request.url.path}", code="not_found"))
        if exc.status_code == 405:
            return answer(APIError(405, f"method {request.method} is not allowed on {request.url.path}"))
        return answer(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientLeft)
    async def _client_left(request: Request, _exc: ClientLeft) -> Response:
        on_error(CLIENT_CLOSED)
        return client_left(request.url.path, "before sending the whole request body")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s on %s: %r", error_id, request.url.path, exc, exc_info=exc)
        return answer(APIError(500, f"internal server error (error id {error_id} in the server log)"))
