"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

User mistakes are 4xx with a message naming the bad value and what is allowed (400 a bad value, 404 an
unknown route or model, 413 a body over the limit, 422 a body that does not fit the schema: malformed
fields, unknown fields, wrong types). The engine never sees a rejected request, so others are undisturbed.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_exceeded",
         503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


async def json_body(request: Request) -> Any:
    """The request's body parsed as JSON; one that is empty, cut short or not UTF-8 is a 400 saying so (Starlette's
    ``request.json()`` raises a ValueError there, which a handler would turn into a 500)."""
    try:
        return await request.json()
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError alike
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error" if status >= 500 else
                                                              "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def describe_validation(errors: list[dict[str, Any]]) -> tuple[int, str, str | None]:
    """(status, message, param) for pydantic's errors: 400 for unparsable JSON, else 422."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return 400, f"the request body is not valid JSON: {detail}".rstrip(": "), None
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or where
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        elif e.get("type") == "missing":
            parts.append(f"{where} is required")
        else:
            parts.append(f"{where}: {e.get('msg')} (got {_short(e.get('input'))})")
    return 422, "; ".join(parts), param


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        status, message, param = describe_validation(list(e.errors()))
        return error_response(status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(e.status_code, message)


DRAIN_FACTOR = 16  # an over-limit body is read (and dropped) up to this many times the limit before the 413


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length, or counted while streaming)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, seen)
                # Starlette's type: FastAPI passes it through (anything else raised while it reads the body
                # becomes its own 400 "error parsing the body"); the handler in ``install`` shapes it.
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes (server.max_body_mib)"

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        if await self._drain(receive, 0):
            await error_response(413, self._message())(scope, receive, send)

    async def _drain(self, receive: Any, drained: int) -> bool:
        """Read the rest of the body, discarding it, before the 413: a client still sending when the server
        answers and closes gets a broken pipe instead of the answer. Past ``DRAIN_FACTOR`` times the limit
        the server stops reading and answers at once. False when the client went away."""
        cap = DRAIN_FACTOR * self.max_bytes
        while drained <= cap:
            message = await receive()
            if message["type"] != "http.request":
                return False
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return True
