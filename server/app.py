"""The aiohttp application: routes, API-key check, and what each route answers.

    POST /v1/completions, /v1/chat/completions   serving.py (OpenAI shapes, SSE streaming)
    POST /v1/embeddings, /pooling                a model that pools: its vectors (embeddings.py)
    POST /score, /rerank (/v1/..., /v2/rerank)   and their cosine similarities
    POST /v1/messages, /v1/messages/count_tokens Anthropic's Messages API
                                                 (anthropic_protocol.py, anthropic_serving.py)
    POST /v1/responses                           OpenAI's Responses API (responses_protocol.py,
    GET, DELETE /v1/responses/{id}               responses_serving.py); stored responses
    POST /v1/responses/{id}/cancel               (responses_store.py): read, forget, cancel
    GET  /v1/responses/{id}/input_items          a background one, list its input
    GET  /v1/models                              the served models (several: model_router.py),
                                                 each with its state (awake, asleep...)
    GET  /health                                 200 while the engine core lives, else 503
                                                 (503 too once the server drains)
    GET  /metrics                                Prometheus text (metrics.py)
    GET  /version                                {"version": "..."}
    POST /tokenize, /detokenize                  vLLM's shapes (tokenization.py)
    POST /reset_prefix_cache                     forget every cached prefix (200, no body)
    POST /v1/load_lora_adapter                   LoRA adapters at run time (--enable-lora;
    POST /v1/unload_lora_adapter                 lora_adapters.py); an adapter's name is a
                                                 `model` of /v1/models, with its parent
    POST /sleep?level=1|2, POST /wake_up         sleep mode (only with --enable-sleep-mode,
    GET  /is_sleeping                            else 404): memory given back, and taken again

A request's `model` picks its engine (`ModelRouter.use`: a sleeping one is woken, an
unloaded one loaded, and the request waits for it); the app is given one `AsyncLLM` or a
`ModelRouter` of several. The app does not own the engines: whoever built them shuts them
down (the CLI, a test). With `api_key`, every route but /health (and /metrics with `open_metrics`) needs
`Authorization: Bearer <key>` or `x-api-key: <key>` (compared in constant time); without one,
only requests whose
Host / Origin name this machine are answered (server/guards.py, DNS rebinding). POST bodies
must be JSON (415 otherwise). Bodies over `max_body_bytes`
are a 413; unknown routes a 404; a wrong method a 405; all in OpenAI's error shape
(Anthropic's under /v1/messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
from http import HTTPStatus
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.frontend.stats import StatLogger
from ringllm.pipeline.messages import wake_bits
from ringllm.server.anthropic_protocol import MessagesRequest, parse_messages_request
from ringllm.server.anthropic_serving import count_tokens, create_message
from ringllm.server.chat_outputs import OutputParsing
from ringllm.server.embeddings import create_embeddings, create_rerank, create_scores
from ringllm.server.errors import (
    AUTHENTICATION,
    SERVER_ERROR,
    ApiError,
    engine_dead_error,
    error_middleware,
    error_response,
)
from ringllm.server.guards import (
    INLINE_JSON_BYTES,
    Drain,
    body_deadline,
    concurrency_limit,
    drain_guard,
    host_check,
    json_only,
    read_json,
)
from ringllm.server.limits import ServerLimits
from ringllm.server.lora_adapters import load_lora_adapter, unload_lora_adapter
from ringllm.server.metrics import ServerMetrics, render_merged
from ringllm.server.model_router import ModelRouter
from ringllm.server.protocol import parse_chat_request, parse_completion_request
from ringllm.server.responses_protocol import ResponsesRequest, parse_responses_request
from ringllm.server.responses_serving import (
    cancel,
    create_response,
    follow,
    input_items_page,
    stored_or_404,
)
from ringllm.server.responses_store import ResponseStore
from ringllm.server.serving import Serving
from ringllm.server.tokenization import detokenize, tokenize

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

# Large enough for a max-length prompt sent as token ids in JSON (~8 bytes a token).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
OPEN_PATHS = frozenset({"/health"})
ROUTER_KEY = web.AppKey("router", ModelRouter)
DRAIN_KEY = web.AppKey("drain", Drain)
RESPONSES_KEY = web.AppKey("responses", ResponseStore)


def served_model_name(
    llm: AsyncLLM, served_name: str | None, model_arg: str | None
) -> tuple[str, frozenset[str]]:
    """(the name the API shows, other names a request's `model` may use).

    The name: --served-model-name, else the model as given when that is a name rather than
    a folder on this machine, else the folder's own name: the API never shows a path of
    this machine. A client that names the model by the path it was started with (vLLM
    shows and takes that path) is still served: the path is an alias, never echoed back."""
    aliases = {model_arg, str(llm.model_path)} - {None, ""}
    if served_name:
        return served_name, frozenset(aliases - {served_name})
    if model_arg and not Path(model_arg).expanduser().exists():
        return model_arg, frozenset(aliases - {model_arg})
    name = Path(llm.model_path).name
    return name, frozenset(aliases - {name})


def create_app(
    llm: AsyncLLM | ModelRouter,
    model_name: str | None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: ServerLimits | None = None,
    allowed_hosts: frozenset[str] | None = None,
    open_metrics: bool = False,
    model_aliases: frozenset[str] = frozenset(),
    parsing: OutputParsing | None = None,
) -> web.Application:
    """`llm`: one engine, served as `model_name` (and `model_aliases`), or a router of
    several (its own names; it makes each model's `Serving` as it loads);
    `allowed_hosts` applies without an API key only (None: any Host); `open_metrics`:
    /metrics answers without the key (for scrapers)."""
    limits = limits or ServerLimits()
    parsing = parsing or OutputParsing()
    router = (
        llm if isinstance(llm, ModelRouter) else ModelRouter.of_one(llm, model_name, model_aliases)
    )

    def make_serving(engine: AsyncLLM, name: str) -> Serving:
        metrics = ServerMetrics(name)
        engine.add_stat_listener(metrics.record)
        engine.add_stat_listener(StatLogger().record)  # the periodic stats line in the log
        return Serving(engine, name, metrics, limits, parsing)

    router.bind(make_serving)
    middlewares = [error_middleware]
    if api_key:
        open_paths = OPEN_PATHS | ({"/metrics"} if open_metrics else set())
        middlewares.append(_auth_middleware(api_key, open_paths))
    elif allowed_hosts is not None:
        middlewares.append(host_check(allowed_hosts))
    drain = Drain()
    middlewares += [
        json_only,
        body_deadline(limits.body_read_timeout_s),  # so that a slow body is counted nowhere
        drain_guard(drain),
        concurrency_limit(limits.max_concurrent_requests),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[DRAIN_KEY] = drain
    app[ROUTER_KEY] = router
    app[RESPONSES_KEY] = ResponseStore(
        limits.max_stored_responses, limits.max_stored_response_bytes
    )
    app.on_shutdown.append(_stop_background_responses)
    app.add_routes(
        [
            web.post("/v1/completions", _completions),
            web.post("/v1/chat/completions", _chat),
            web.post("/v1/embeddings", _embeddings),
            web.post("/pooling", _pooling),
            web.post("/score", _score),
            web.post("/v1/score", _score),
            web.post("/rerank", _rerank),
            web.post("/v1/rerank", _rerank),
            web.post("/v2/rerank", _rerank),
            web.post("/v1/messages", _messages),
            web.post("/v1/messages/count_tokens", _count_tokens),
            web.post("/v1/responses", _responses),
            web.get("/v1/responses/{response_id}", _get_response),
            web.delete("/v1/responses/{response_id}", _delete_response),
            web.post("/v1/responses/{response_id}/cancel", _cancel_response),
            web.get("/v1/responses/{response_id}/input_items", _input_items),
            web.get("/v1/models", _models),
            web.get("/health", _health),
            web.get("/metrics", _metrics),
            web.get("/version", _version),
            web.post("/tokenize", _tokenize),
            web.post("/detokenize", _detokenize),
            web.post("/reset_prefix_cache", _reset_prefix_cache),
        ]
    )
    if any(h.spec.config.lora.enable_lora for h in router.hosted()):
        app.add_routes(
            [
                web.post("/v1/load_lora_adapter", _load_lora_adapter),
                web.post("/v1/unload_lora_adapter", _unload_lora_adapter),
            ]
        )
    if any(h.spec.config.model.enable_sleep_mode for h in router.hosted()):
        app.add_routes(
            [
                web.post("/sleep", _sleep),
                web.post("/wake_up", _wake_up),
                web.get("/is_sleeping", _is_sleeping),
            ]
        )
    return app


def _auth_middleware(api_key: str, open_paths: frozenset[str]):
    """The key as OpenAI's clients send it (`Authorization: Bearer KEY`) or as Anthropic's
    do (`x-api-key: KEY`), on every path."""
    expected, expected_bare = f"Bearer {api_key}".encode(), api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths:
            # aiohttp decodes header bytes that are not UTF-8 as surrogate escapes: encode
            # them back to those bytes, which then simply differ from the key's
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            given_x = request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
            bearer_ok = hmac.compare_digest(given, expected)
            if not (bearer_ok or hmac.compare_digest(given_x, expected_bare)):
                raise ApiError(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>')",
                    status=HTTPStatus.UNAUTHORIZED,
                    error_type=AUTHENTICATION,
                    code="invalid_api_key",
                )
        return await handler(request)

    return check_api_key


def _use_model(request: web.Request, body) -> contextlib.AbstractAsyncContextManager[Serving]:
    """The `Serving` of the model the body names, awake for the handler's run (a sleeping
    model is woken and this request waits for it); 404 `model_not_found` for a name this
    server does not serve."""
    model = body.get("model") if isinstance(body, dict) else None
    return request.app[ROUTER_KEY].use(model)


def _default_serving(request: web.Request) -> Serving:
    """The first model's `Serving` (what every model shares: limits, parsers)."""
    return request.app[ROUTER_KEY].default.serving


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        req = parse_completion_request(body, serving.limits, serving.llm.max_model_len)
        return await serving.completions(request, req)


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        parse = functools.partial(
            parse_chat_request,
            body,
            serving.limits,
            serving.llm.max_model_len,
            serving.parsing.auto_tool_choice,
        )
        req = await _parse_off_the_loop(request, body, parse)
        return await serving.chat(request, req)


async def _embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return web.json_response(await create_embeddings(serving, body))


async def _pooling(request: web.Request) -> web.Response:
    """vLLM's /pooling: the same inputs, each vector as `data` (always floats)."""
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        response = await create_embeddings(serving, body)
    for item in response["data"]:
        item["object"], item["data"] = "pooling", item.pop("embedding")
    response["id"] = "pool" + response["id"][len("embd") :]
    return web.json_response(response)


async def _score(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return web.json_response(await create_scores(serving, body))


async def _rerank(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return web.json_response(await create_rerank(serving, body))


async def _parse_off_the_loop(request: web.Request, body, parse):
    """`parse()` on the loop for a small body without tools, else on a worker thread: each
    tool's schema is meta-validated (milliseconds each), never on the loop."""
    if len(await request.read()) <= INLINE_JSON_BYTES and not _has_tools(body):
        return parse()
    return await asyncio.get_running_loop().run_in_executor(None, parse)


async def _parsed_messages(
    request: web.Request, serving: Serving, body, counting: bool = False
) -> MessagesRequest:
    """An Anthropic Messages body, checked and translated (off the loop as chat's is)."""
    parse = functools.partial(
        parse_messages_request,
        body,
        serving.limits,
        serving.llm.max_model_len,
        serving.parsing.auto_tool_choice,
        counting,
    )
    return await _parse_off_the_loop(request, body, parse)


async def _messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        req = await _parsed_messages(request, serving, body)
        return await create_message(serving, request, req)


async def _count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        req = await _parsed_messages(request, serving, body, counting=True)
        return await count_tokens(serving, req)


async def _responses(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return await _respond(request, serving, body)


async def _respond(request: web.Request, serving: Serving, body) -> web.StreamResponse:
    store = request.app[RESPONSES_KEY]
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    history = []
    if isinstance(previous, str):
        stored = store.get(previous)
        if stored is None:
            raise ApiError(
                f"previous_response_id: response {previous!r} is not stored here (never "
                "stored, deleted, or evicted: --max-stored-responses)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if stored.running or stored.response["status"] in ("queued", "in_progress"):
            raise ApiError(
                f"previous_response_id: response {previous!r} has not finished yet",
                param="previous_response_id",
            )
        history = stored.conversation
    parse = functools.partial(
        parse_responses_request,
        body,
        serving.limits,
        serving.llm.max_model_len,
        serving.parsing.auto_tool_choice,
        history,
        store.items,
    )
    req: ResponsesRequest = await _parse_off_the_loop(request, body, parse)
    return await create_response(serving, request, req, store, history)


async def _get_response(request: web.Request) -> web.StreamResponse:
    """The stored response; with ?stream=true a background one's events (after
    ?starting_after=N) and on to its end."""
    stored = stored_or_404(request.app[RESPONSES_KEY], request.match_info["response_id"])
    if request.query.get("stream", "false").lower() != "true":
        return web.json_response(stored.response)
    if not stored.response["background"]:
        raise ApiError(
            "stream: only a background response's events are kept to be streamed again",
            param="stream",
        )
    try:
        after = int(request.query.get("starting_after", "-1"))
    except ValueError:
        raise ApiError("starting_after: must be an integer", param="starting_after") from None
    return await follow(request, _default_serving(request), stored, after)


async def _delete_response(request: web.Request) -> web.Response:
    store, response_id = request.app[RESPONSES_KEY], request.match_info["response_id"]
    stored = stored_or_404(store, response_id)
    if stored.running:
        await cancel(store, response_id)
    store.delete(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def _cancel_response(request: web.Request) -> web.Response:
    store = request.app[RESPONSES_KEY]
    return web.json_response(await cancel(store, request.match_info["response_id"]))


async def _input_items(request: web.Request) -> web.Response:
    stored = stored_or_404(request.app[RESPONSES_KEY], request.match_info["response_id"])
    return web.json_response(input_items_page(stored, request.query))


async def _stop_background_responses(app: web.Application) -> None:
    """Background responses end with the server (their engine requests aborted)."""
    store = app[RESPONSES_KEY]
    for stored in store.running():
        await cancel(store, stored.response["id"])


def _has_tools(body) -> bool:
    return isinstance(body, dict) and bool(body.get("tools"))


async def _models(request: web.Request) -> web.Response:
    """Every model served, with its state where the server hosts several (awake, asleep,
    unloaded...: model_router.py)."""
    router = request.app[ROUTER_KEY]
    cards = []
    for hosted in router.hosted():
        llm = hosted.llm
        card = {
            "id": hosted.name,
            "object": "model",
            "created": 0,
            "owned_by": "ringllm",
            "root": hosted.name,  # never the model's path on this machine
            "parent": None,
            "max_model_len": llm.max_model_len if llm else hosted.spec.config.model.max_model_len,
        }
        if router.multi or router.policy.manages_sleep:
            card["status"] = hosted.card()
        cards.append(card)
        for name in hosted.loras:  # vLLM lists an adapter as a model with its parent
            cards.append({**card, "id": name, "root": name, "parent": hosted.name})
    return web.json_response({"object": "list", "data": cards})


async def _load_lora_adapter(request: web.Request) -> web.Response:
    return await load_lora_adapter(request, request.app[ROUTER_KEY])


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    return await unload_lora_adapter(request, request.app[ROUTER_KEY])


async def _health(request: web.Request) -> web.Response:
    """200 while every loaded engine core lives (a sleeping one too), else 503."""
    if request.app[DRAIN_KEY].draining:  # a load balancer stops sending at once
        return error_response(
            ApiError(
                "the server is shutting down",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
                error_type="server_error",
                code="server_shutting_down",
            )
        )
    router = request.app[ROUTER_KEY]
    for hosted in router.hosted():
        try:
            if hosted.llm is not None:
                hosted.llm.check_health()
        except EngineDeadError as exc:
            if router.multi:
                exc = EngineDeadError(f"model {hosted.name!r}: {exc}")
            return error_response(engine_dead_error(exc))
    return web.Response(status=HTTPStatus.OK)


async def _metrics(request: web.Request) -> web.Response:
    servings = [h.serving for h in request.app[ROUTER_KEY].hosted() if h.serving is not None]
    for serving in servings:
        serving.metrics.count_restarts(getattr(serving.llm, "num_restarts", 0))
        serving.metrics.engine_sleep_level.set(getattr(serving.llm, "sleep_level", 0))
    response = web.Response(body=render_merged([s.metrics for s in servings]))
    response.headers["Content-Type"] = servings[0].metrics.content_type
    return response


async def _version(request: web.Request) -> web.Response:
    try:
        version = metadata.version("ringllm")
    except metadata.PackageNotFoundError:
        version = "unknown (ringllm is not installed)"
    return web.json_response({"version": version})


async def _tokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return web.json_response(text=await tokenize(serving.llm, body))


async def _detokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    async with _use_model(request, body) as serving:
        return web.json_response(text=await detokenize(serving.llm, body))


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's: the engines forget every cached prefix (blocks in use stay allocated; a
    sleeping engine has none). A full request ring is a 503 with Retry-After, as for a
    generation."""
    for hosted in request.app[ROUTER_KEY].hosted():
        if hosted.llm is not None and not hosted.llm.is_sleeping():
            hosted.llm.reset_prefix_cache()
    return web.Response(status=HTTPStatus.OK)


async def _sleep(request: web.Request) -> web.Response:
    """vLLM's: level 1 offloads the weights, 2 drops them; both free the KV cache. From
    now on generation requests get 503 `engine_sleeping` (with several models, or with
    an idle time: the next request wakes it); those under way pause and go on after
    /wake_up. 200 once the engine is asleep; a 500 `sleep_failed` when it could not sleep
    (a level 1 whose disk is full), and the engine then serves on, awake. `?model=NAME`
    picks one of several models (default: the first)."""
    level = _sleep_level(request.query.get("level", "1"))
    router = request.app[ROUTER_KEY]
    try:
        await router.sleep_model(router.lookup(request.query.get("model")), level)
    except ValueError as exc:  # the engine's answer: it refused or failed, and is awake
        raise ApiError(
            str(exc),
            status=HTTPStatus.INTERNAL_SERVER_ERROR,
            error_type=SERVER_ERROR,
            code="sleep_failed",
        ) from None
    return web.Response(status=HTTPStatus.OK)


async def _wake_up(request: web.Request) -> web.Response:
    """200 once weights and KV cache are back and new requests are taken again; with
    `?tags=weights` (or `kv_cache`; repeatable, vLLM's) only those parts, and the engine
    stays asleep until the rest. `?model=NAME` as for /sleep (an unloaded one is loaded)."""
    tags = request.query.getall("tags", [])
    try:
        wake_bits(tags)
    except ValueError as exc:
        raise ApiError(str(exc), param="tags") from None
    router = request.app[ROUTER_KEY]
    await router.wake_model(router.lookup(request.query.get("model")), tags or None)
    return web.Response(status=HTTPStatus.OK)


async def _is_sleeping(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    llm = router.lookup(request.query.get("model")).llm
    if llm is None:  # never loaded: nothing in memory, as asleep at level 2
        return web.json_response({"is_sleeping": True, "sleep_level": 2})
    return web.json_response({"is_sleeping": llm.is_sleeping(), "sleep_level": llm.sleep_level})


def _sleep_level(text: str) -> int:
    if text.strip() not in ("1", "2"):
        raise ApiError(f"level: {text!r} is not a sleep level (1 or 2)", param="level")
    return int(text)
