"""What stands between a client's bytes and the endpoints: the body reader and the
middlewares that refuse what no endpoint should see.

    read_json          the body (413 past --max-body-bytes), parsed off the event loop when
                       large; 400 for what is not strict JSON: NaN / Infinity, integers past
                       the parser's digit limit, nesting past MAX_JSON_DEPTH, strings that
                       are not text (lone surrogates: no tokenizer takes them). JSON sent
                       inside a string (tool-call arguments) is held to the same rules
    json_only          POST bodies must be `Content-Type: application/json` (415): a web page
                       cannot send that cross-origin without a CORS preflight, which this
                       server never grants, so a "simple" cross-origin POST cannot drive it
    host_check         without --api-key, only Host names that mean this machine (loopback
                       names, the --host value, this host's own names, --allowed-hosts) and
                       Origins with such a host: a DNS-rebinding page cannot reach a local server
    body_deadline      a POST body is read whole before anything counts the request, within
                       --body-read-timeout-s (408, and the connection is closed): a client
                       that sends its body slowly, or never, holds a socket for that long,
                       never a place under the concurrency limit
    concurrency_limit  at most --max-concurrent-requests requests served at once; the next
                       one gets 503 with Retry-After at once instead of queueing without bound
    drain_guard        once the server drains (SIGTERM), new generation requests get 503
                       with Retry-After; it counts the ones in flight for the drain to wait on
    OneLineBadRequests aiohttp's log of a request it could not parse (a bad request line,
                       URL or header): one line, not a traceback, whoever sends them
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ringllm.server.errors import (
    ANTHROPIC_PATH,
    ApiError,
    body_timeout_error,
    busy_error,
    error_response,
)

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger
# ones on a worker thread, so one big body does not stall every other client.
INLINE_JSON_BYTES = 64 * 1024
# NOTE: no OpenAI request nests this deep (llguidance enforces JSON schemas of objects to
# ~64 levels, two each here). Deeper input would reach code that recurses over it (the JSON
# encoder, jsonschema's meta-check, which fails past ~120, templates) as a RecursionError.
MAX_JSON_DEPTH = 100
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Control endpoints that take no body: a POST without one is fine there. (A cross-site page
# could send one; the Origin check or the API key stops it.)
BODYLESS_PATHS = frozenset({"/reset_prefix_cache", "/sleep", "/wake_up"})


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (use a finite number)")


class _TooDeep(Exception):
    """Nesting past MAX_JSON_DEPTH: answered as the parser's own RecursionError is."""


def _check_parsed(value: Any) -> None:
    """Every string of a parsed body is valid text (`str.encode` fails on lone surrogates,
    which JSON's \\ud800 escapes can produce and no tokenizer takes), and nothing nests
    deeper than MAX_JSON_DEPTH. A loop, not recursion: any depth json.loads built."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _TooDeep
        if isinstance(item, dict):
            for key, inner in item.items():
                key.encode("utf-8")
                stack.append((inner, depth + 1))
        else:
            stack.extend((inner, depth + 1) for inner in item)


def parse_json(raw: bytes | str, what: str = "the request body") -> Any:
    """Strict JSON (a request body, or JSON text inside one: `what` names it), or ApiError
    (400) saying what is wrong."""
    too_deep = f"{what} nests arrays or objects too deeply (at most {MAX_JSON_DEPTH} levels)"
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
        _check_parsed(value)
        return value
    except UnicodeEncodeError as exc:
        raise ApiError(
            f"{what} holds a string that is not valid text (a lone UTF-16 surrogate, "
            f"{exc.object[exc.start : exc.end]!r}); send UTF-8 text"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"{what} is not valid JSON: {exc}") from None
    except (RecursionError, _TooDeep):
        raise ApiError(too_deep) from None
    except ValueError as exc:  # NaN / Infinity, or an integer past Python's digit limit
        raise ApiError(f"{what} is not valid JSON: {exc}") from None


async def read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises 413 past client_max_size
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json(raw)
    return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)


@web.middleware
async def json_only(request: web.Request, handler) -> web.StreamResponse:
    if request.method == "POST" and request.content_type != "application/json":
        bodyless = request.path in BODYLESS_PATHS or (
            request.path.startswith("/v1/responses/") and request.path.endswith("/cancel")
        )
        if bodyless and not request.body_exists:
            return await handler(request)  # a control call without a body (curl -X POST)
        got = request.headers.get("Content-Type") or "none"
        raise ApiError(
            f"the request body must be JSON, sent as 'Content-Type: application/json' "
            f"(got {got!r})",
            status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        )
    return await handler(request)


def allowed_host_names(bound_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names a server without an API key answers (None: any, from '*')."""
    extra = [e.strip().lower() for e in extra if e.strip()]
    if "*" in extra:
        return None
    names = set(LOOPBACK_NAMES) | set(extra)
    if bound_host.lower() not in WILDCARD_HOSTS:
        names.add(bound_host.lower())
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
    return frozenset(names)


def _host_part(value: str) -> str:
    """'example.com:8000' / '[::1]:8000' / 'http://x:1' -> the host, lower case."""
    if "://" in value:
        return (urlsplit(value).hostname or "").lower()
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_check(allowed: frozenset[str]):
    @web.middleware
    async def check_host(request: web.Request, handler) -> web.StreamResponse:
        host = _host_part(request.headers.get("Host", ""))
        origin = request.headers.get("Origin")
        if host not in allowed or (origin is not None and _host_part(origin) not in allowed):
            raise ApiError(
                f"this server answers only requests addressed to this machine (Host / Origin "
                f"{host!r}); set --api-key, or name the host with --allowed-hosts",
                status=HTTPStatus.FORBIDDEN,
                code="host_not_allowed",
            )
        return await handler(request)

    return check_host


def body_deadline(timeout_s: float):
    """Reads a POST's body (aiohttp keeps it: the handler's read() takes it at no cost)
    before the middlewares after this one count the request."""

    @web.middleware
    async def read_body(request: web.Request, handler) -> web.StreamResponse:
        if request.method == "POST" and request.body_exists:
            try:
                await asyncio.wait_for(request.read(), timeout_s)
            except TimeoutError:
                return await _refuse_and_close(request, body_timeout_error(timeout_s))
        return await handler(request)

    return read_body


async def _refuse_and_close(request: web.Request, error: ApiError) -> web.StreamResponse:
    """Sends `error`, then closes the connection: without this aiohttp would go on reading
    the rest of the body (its lingering close, 10 s) from a client that is too slow."""
    response = error_response(error, request.path.startswith(ANTHROPIC_PATH))
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def concurrency_limit(max_requests: int):
    busy = 0

    @web.middleware
    async def limit(request: web.Request, handler) -> web.StreamResponse:
        nonlocal busy
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        if busy >= max_requests:
            raise busy_error(
                f"the server is serving {busy} requests, its limit "
                f"(--max-concurrent-requests); retry shortly"
            )
        busy += 1
        try:
            return await handler(request)
        finally:
            busy -= 1

    return limit


class Drain:
    """The server's shutdown state: `start()` on SIGTERM; `in_flight` generation requests
    are waited on (`wait_idle`) before the server goes."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """True once nothing is in flight; False after `timeout_s` or once `hurry` is set."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()


def drain_guard(drain: Drain):
    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        if drain.draining:
            raise ApiError(
                "the server is shutting down and takes no new requests; retry on another "
                "replica, or once it is back",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
                error_type="server_error",
                code="server_shutting_down",
                headers={"Retry-After": "1"},
            )
        drain.enter()
        try:
            return await handler(request)
        finally:
            drain.leave()

    return guard


class OneLineBadRequests(logging.Filter):
    """For aiohttp's "aiohttp.server" logger, which logs every request it cannot parse at
    ERROR with a traceback: anyone could flood the log with them. Such a record becomes
    one INFO line saying who sent what; the client got its 400 either way."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = exc.message.strip().splitlines()[0].rstrip(":") if exc.message.strip() else "?"
            record.msg = "refused a malformed HTTP request from %s (%s): %s"
            sender = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.args = (sender, exc.code, why)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True
