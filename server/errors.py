"""OpenAI error bodies, and the middleware that turns every failure into one.

Every error a client sees has OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

except under Anthropic's Messages API (`/v1/messages...`), which answers in its own:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

Invariants: no handler failure reaches a client as aiohttp's HTML page or a stack trace;
a client's mistake is a 4xx naming the field (`param`) and what was wrong with it; a dead
engine core is a 503; anything else is a 500 whose text says only that the server failed
(the traceback goes to the log, not to the client).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web

from ringllm.pipeline.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineRestartingError,
    EngineSleepingError,
    HostLostError,
    RequestFailedError,
    SlowReaderError,
)

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
ENGINE_DEAD_CODE = "engine_dead"

# aiohttp's own HTTP errors (routing, body size) mapped to OpenAI's error types.
_HTTP_ERROR_TYPES = {
    HTTPStatus.UNAUTHORIZED: AUTHENTICATION,
    HTTPStatus.NOT_FOUND: NOT_FOUND,
}


class ApiError(Exception):
    """An error answered to the client as an OpenAI error body with `status`."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        error_type: str = INVALID_REQUEST,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.error_type = error_type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def engine_dead_error(exc: BaseException) -> ApiError:
    """503 engine_dead. What died and how (pids, ring names, exit codes) goes to the log,
    not to the client; a lost host (503 host_lost) is named, with when: what to bring back
    (the front end logged it once)."""
    if isinstance(exc, HostLostError):
        return unavailable_error(str(exc), "host_lost", 5)
    if isinstance(exc, EngineRestartingError):
        return ApiError(
            "the engine is restarting; retry shortly",
            status=HTTPStatus.SERVICE_UNAVAILABLE,
            error_type=SERVER_ERROR,
            code="engine_restarting",
            headers={"Retry-After": "1"},
        )
    logger.error("engine not running: %s", exc)
    return ApiError(
        "the engine is not running, so the request cannot be served",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        error_type=SERVER_ERROR,
        code=ENGINE_DEAD_CODE,
    )


def unavailable_error(message: str, code: str, retry_after_s: int) -> ApiError:
    """503 with Retry-After: a state the server comes out of by itself."""
    return ApiError(
        message,
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        error_type=SERVER_ERROR,
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def busy_error(message: str, retry_after_s: int = 1) -> ApiError:
    """503 with Retry-After: the server is full for a moment, not broken."""
    return unavailable_error(message, "server_busy", retry_after_s)


def body_timeout_error(timeout_s: float) -> ApiError:
    """408: the client did not send its whole body in time."""
    return ApiError(
        f"the request body did not arrive within {timeout_s:g} s (--body-read-timeout-s); "
        "send it at once",
        status=HTTPStatus.REQUEST_TIMEOUT,
        code="body_timeout",
    )


def invalid_value(exc: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """A 400 for an engine ValueError whose text starts with the field it names ("top_p: ...").

    `rename` maps engine field names to the OpenAI name the client used.
    """
    message = str(exc)
    field, sep, _ = message.partition(":")
    param = None
    if sep and field.isidentifier():
        param = (rename or {}).get(field, field)
        if param != field:
            message = param + message[len(field) :]
    return ApiError(message, param=param)


class ServerShuttingDownError(RuntimeError):
    """A request still running when the drain timed out: ended, not finished."""


def to_api_error(exc: BaseException) -> ApiError:
    """The client-facing error for any exception a handler raised."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead_error(exc)
    if isinstance(exc, EngineBusyError):
        return busy_error("the engine is busy (its request queue is full); retry shortly")
    if isinstance(exc, EngineSleepingError):
        return unavailable_error(str(exc), "engine_sleeping", 5)
    if isinstance(exc, ServerShuttingDownError):
        return ApiError(
            str(exc),
            status=HTTPStatus.SERVICE_UNAVAILABLE,
            error_type=SERVER_ERROR,
            code="server_shutting_down",
        )
    if isinstance(exc, RequestFailedError):
        # The engine's fault, not the client's, and the engine goes on: a 500 that says so,
        # without the engine's own words (they are in its log).
        return ApiError(
            "the engine failed while computing this request and ended it; other requests "
            "are unaffected (the cause is in the server's log)",
            status=HTTPStatus.INTERNAL_SERVER_ERROR,
            error_type=SERVER_ERROR,
            code="request_failed",
        )
    if isinstance(exc, SlowReaderError):
        return ApiError(str(exc), status=HTTPStatus.REQUEST_TIMEOUT, code="slow_reader")
    if isinstance(exc, web.HTTPException):
        status = HTTPStatus(exc.status)
        message = f"{status.phrase}: {exc.text}" if exc.text else status.phrase
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
            message = f"method {exc.method} is not allowed here; use {allowed}"
        error_type = _HTTP_ERROR_TYPES.get(status, INVALID_REQUEST)
        if status >= 500:
            error_type = SERVER_ERROR
        return ApiError(message, status=status, error_type=error_type)
    logger.exception("request failed", exc_info=exc)
    return ApiError(
        "the server failed while handling this request (see the server log)",
        status=HTTPStatus.INTERNAL_SERVER_ERROR,
        error_type=SERVER_ERROR,
    )


# Anthropic's error types by HTTP status (its 529 "overloaded" is our 503)
_ANTHROPIC_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(error: ApiError) -> dict:
    status = HTTPStatus(error.status)
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError, anthropic: bool = False) -> web.Response:
    body = anthropic_error_body(error) if anthropic else error.body()
    return web.json_response(body, status=error.status, headers=error.headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPSuccessful:
        raise
    except web.HTTPRedirection:
        raise
    except ConnectionResetError:
        raise  # the client is gone: there is no one to answer
    except web.HTTPNotFound:
        error = ApiError(
            f"{request.method} {request.path}: no such route",
            status=HTTPStatus.NOT_FOUND,
            error_type=NOT_FOUND,
        )
        return error_response(error, request.path.startswith(ANTHROPIC_PATH))
    except Exception as exc:  # every failure becomes an OpenAI (or Anthropic) error body
        return error_response(to_api_error(exc), request.path.startswith(ANTHROPIC_PATH))
