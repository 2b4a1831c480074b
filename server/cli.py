"""`ringllm serve [MODEL]`: the OpenAI-compatible HTTP server.

    ringllm serve                                   # the demo model on 127.0.0.1:8000
    ringllm serve ./my-model --port 0 --api-key s3cret --max-num-seqs 64
    ringllm serve --model a.gguf --model chat=./b --model-idle-s 300   # several models

Starts the engine (and waits until it is ready), then listens, and prints one line
`ringllm serve: listening on http://HOST:PORT` (with `--port 0` the port the OS chose),
followed by the engine's IPC instance name when it runs in its own process. SIGINT and
SIGTERM stop the listener, then shut the engine down (its process and shared memory
with it); the command then exits 0.

Several models (`--model` again, or `--models-dir`): one engine core each, requests routed
by `model`, the first loaded at start and the others at their first request; idle ones
sleep, and a memory budget puts the least recently used to sleep (server/model_router.py).
Every engine flag applies to each model.

Engine flags are spelled as vLLM spells them (`ringllm.pipeline.config.add_cli_args`).
Also `python -m ringllm.server.cli [MODEL] ...` (the same flags, without `serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from ringllm.pipeline.child_process import freeze_heap
from ringllm.pipeline.config import DeviceConfig, EngineConfig, add_cli_args, from_cli_args
from ringllm.pipeline.engine.engine_core_proc import check_model
from ringllm.pipeline.frontend.supervisor import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S
from ringllm.server.app import DEFAULT_MAX_BODY_BYTES, create_app, served_model_name
from ringllm.server.chat_outputs import OutputParsing
from ringllm.server.guards import OneLineBadRequests, allowed_host_names
from ringllm.server.limits import add_limit_args, limits_from_args
from ringllm.server.lora_adapters import parse_lora_modules
from ringllm.server.model_router import ModelRouter, ModelSpec, RouterPolicy, with_model

logger = logging.getLogger(__name__)

# NOTE: the engine core runs in its own process behind the shared-memory rings (the
# design's default); `--no-engine-process` runs it in a thread of the server instead.
# The server itself does not care which it gets.
ENGINE_IN_OWN_PROCESS = True

# NOTE: on a CPU, `serve` schedules at most this many tokens a step unless told otherwise
# (the offline API keeps the engine's 2,048). A CPU step costs in proportion to its tokens,
# and 64 rows already keep the matrix products at the FMA units' peak, so a big budget only
# prefills every waiting prompt in one long step before any of them gets its first token.
# Measured (`ringllm bench serve`, 64 prompts, 64 in / 32 out, concurrency 16, fresh
# prompts each run): AVX-512 BF16, 2,048 -> 512: median TTFT 292-299 -> 171-183 ms at the
# same output rate (624-641 vs 613-647 tok/s); AVX2 (emulated) 1,003-1,037 -> 537-548 ms,
# 246-250 -> 267-271 tok/s. The cost: a step that carries a 512-token chunk is a longer
# gap for the requests decoding beside it (P99 ITL 24 -> 123 ms, AVX-512).
CPU_SERVE_BATCHED_TOKENS = 512
# NOTE: and it keeps prompts from stalling the streams decoding beside them: a step with
# decodes in it takes prompt tokens only up to AUTO_ITL_FACTOR (1.5) times a long recent step
# of the decodes alone (their 90th percentile: SchedulerConfig target_itl auto; on Zen 5,
# 2026-12-07, 2x let the P99 ITL reach 39-52 ms, 1.5x held it at 33-38, docs/server.md).
# Off against 2x, measured (same workload, demo Q4_1, Zen 3, 2026-12-04): P99 ITL 420-539
# -> 112-115 ms, median TTFT 589-707 -> 706-793 ms, output rate 218-273 -> 182-201 tok/s;
# vLLM's CPU build there: 128-294 ms, 1,860-1,982 ms, 108-112 tok/s.
CPU_SERVE_TARGET_ITL = "auto"
# aiohttp keeps an idle keep-alive connection for an hour by default; this server, 15 s.
KEEPALIVE_TIMEOUT_S = 15.0
SHUTDOWN_TIMEOUT_S = 30.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    configure_parser(p)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="HF model folder; default: the demo model",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=ENGINE_IN_OWN_PROCESS,
        help="run the engine core in its own process over shared-memory rings",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body in bytes (larger: 413)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="without --api-key, Host names besides this machine's own that the server answers "
        "(comma-separated; '*': any). Guards a local server against DNS rebinding",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="with --api-key, answer /metrics without the key (for scrapers)",
    )
    p.add_argument(
        "--engine-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="an engine core process that dies is restarted and its requests replayed, up "
        "to this many times within --engine-restart-window-s (one more: a crash loop, "
        "503 engine_dead from then on); 0: never restart",
    )
    p.add_argument(
        "--engine-restart-window-s",
        type=float,
        default=DEFAULT_RESTART_WINDOW_S,
        help="the window --engine-restarts counts deaths in",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": tool calls are parsed out of what the model writes (needs '
        "--tool-call-parser)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: " + ", ".join(_tool_parser_names()),
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="move the model's thinking (<think>...</think>) into reasoning_content: "
        + ", ".join(_reasoning_parser_names()),
    )
    p.add_argument(
        "--engine-standby",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a warm standby engine core (a spare process with torch and the engine "
        "imported) so that a restart costs only the model load; --no-engine-standby saves "
        "its memory. Single core only (not with --data-parallel-size > 1); default: on "
        "with one model, off with several",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM / SIGINT, how long requests in flight may run to their end (new "
        "ones: 503) before the rest are ended with an error; a second signal: at once",
    )
    p.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=KEEPALIVE_TIMEOUT_S,
        help="an idle keep-alive connection is closed after this long",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="with --nnodes N --node-rank R (R > 0) --master-addr HEAD: run this host's "
        "worker ranks for the engine on the head, no server (vLLM's --headless)",
    )
    add_model_args(p)
    add_limit_args(p)
    add_cli_args(p, skip=("model",))
    p.set_defaults(func=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The models a server hosts, and when they sleep (server/model_router.py)."""
    group = p.add_argument_group("models")
    group.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]PATH",
        help="HF model folder, or a GGUF file (or a folder holding one), served as it is; "
        "default: the demo model. Again for more models on one server (NAME=PATH: the name "
        "the API shows; default: the folder's or file's name)",
    )
    group.add_argument(
        "--models-dir",
        default=None,
        help="serve every model in this folder: its .gguf files and its model folders",
    )
    group.add_argument(
        "--model-idle-s",
        type=float,
        default=None,
        help="a model with no request for this many seconds sleeps; its next request wakes "
        "it (and waits for it). Default: never",
    )
    group.add_argument(
        "--model-sleep-level",
        type=int,
        default=1,
        choices=(1, 2),
        help="how a model sleeps: 1 keeps its weights in a file, 2 drops them (a wake loads "
        "them again); both free its KV cache",
    )
    group.add_argument(
        "--models-memory-bytes",
        type=int,
        default=None,
        help="what the models may keep resident together (each engine process measured); "
        "before a model loads or wakes, the least recently used idle ones sleep until it fits",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served with --enable-lora, each a model to the API: "
        'name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...} (with several '
        "models; default: the first)",
    )
    group.add_argument(
        "--models-max",
        type=int,
        default=None,
        help="at most this many models awake at once (llama.cpp's router); the least "
        "recently used idle one sleeps first",
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config of the first model (the others: `model_specs`)."""
    models = _model_args(args)
    args.model = models[0][1] if models else None
    on_cpu = DeviceConfig(device=args.device or "auto").resolve() == "cpu"
    if args.max_num_batched_tokens is None and args.enable_chunked_prefill is not False and on_cpu:
        args.max_num_batched_tokens = CPU_SERVE_BATCHED_TOKENS
    if args.target_itl is None and on_cpu:
        args.target_itl = CPU_SERVE_TARGET_ITL
    return from_cli_args(args)


def _model_args(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """(name or None, path) of every model asked for, in order: MODEL, each --model, then
    the --models-dir's entries (read once: `args.model` then becomes the first's path, as
    the engine config reads it)."""
    if getattr(args, "model_list", None) is not None:
        return args.model_list
    given = list(args.model or [])
    if args.model_tag is not None:
        if len(given) == 1 and given[0] != args.model_tag:
            raise SystemExit(
                f"ringllm serve: MODEL {args.model_tag!r} and --model {given[0]!r} disagree; "
                "give one (or --model again for more models)"
            )
        if args.model_tag not in given:
            given.insert(0, args.model_tag)
    models = [_named(text) for text in given]
    if args.models_dir is not None:
        models += [(None, str(path)) for path in models_in(args.models_dir)]
    args.model_list = models
    return models


def _named(text: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a path (even one holding '=') -> (None, PATH)."""
    name, sep, path = text.partition("=")
    if not sep or Path(text).expanduser().exists() or not name or "/" in name:
        return None, text
    return name, path


def models_in(folder: str) -> list[Path]:
    """A models folder's entries: .gguf files and model folders (config.json, or one
    .gguf), sorted by name."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise SystemExit(f"ringllm serve: --models-dir {folder}: not a folder")
    found = [
        entry
        for entry in sorted(root.iterdir())
        if (entry.is_file() and entry.suffix == ".gguf")
        or (entry.is_dir() and ((entry / "config.json").is_file() or any(entry.glob("*.gguf"))))
    ]
    if not found:
        raise SystemExit(
            f"ringllm serve: --models-dir {folder} holds no model (.gguf files or folders "
            "with a config.json)"
        )
    return found


def model_specs(args: argparse.Namespace, config: EngineConfig) -> list[ModelSpec]:
    """One spec per model: its served name, the path as an alias, the engine config with
    that model (sleep mode on where models sleep)."""
    models = _model_args(args)
    sleeps = _policy(args).manages_sleep or len(models) > 1
    if len(models) > 1 and config.model.served_model_name:
        raise SystemExit(
            "ringllm serve: --served-model-name names one model; with several, name each "
            "as --model NAME=PATH"
        )
    specs = []
    for name, path in models or [(None, None)]:
        if name is None:
            name = config.model.served_model_name or _name_of(path)
        aliases = frozenset({path} - {None, name})
        specs.append(ModelSpec(name, with_model(config, path, sleeps), aliases))
    return specs


def _name_of(path: str | None) -> str:
    if path is None:
        from ringllm.pipeline import DEMO_MODEL_NAME

        return DEMO_MODEL_NAME
    resolved = Path(path).expanduser()
    return resolved.stem if resolved.suffix == ".gguf" else resolved.resolve().name


def _policy(args: argparse.Namespace) -> RouterPolicy:
    try:
        return RouterPolicy(
            args.model_idle_s, args.model_sleep_level, args.models_memory_bytes, args.models_max
        )
    except ValueError as exc:
        raise SystemExit(f"ringllm serve: {exc}") from None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if args.max_body_bytes < 1:
        raise SystemExit(f"--max-body-bytes: must be >= 1 byte, got {args.max_body_bytes}")
    try:
        limits_from_args(args)
        output_parsing_from_args(args)  # before the engine loads: a bad flag fails at once
    except ValueError as exc:
        raise SystemExit(f"ringllm serve: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
    config = _engine_config(args)  # a ValueError: said in one line by main (exit 2)
    # (a headless host runs the ranks of the head's spec: the head checks the split)
    tp_size = 1 if args.headless else config.parallel.tensor_parallel_size
    for path in [path for _, path in _model_args(args)] or [None]:
        check_model(path, tp_size)  # every model, before any loads
    if args.headless:
        from ringllm.pipeline.engine.headless import run_headless

        return run_headless(config)
    # SIGTERM while the engine loads: unwind through the same clean-up as SIGINT.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        asyncio.run(_serve(config, args))
    except KeyboardInterrupt:
        logger.info("interrupted before the server was up; engine shut down")
    return 0


def _tool_parser_names() -> list[str]:
    from ringllm.server.tool_parsers import TOOL_PARSER_NAMES

    return list(TOOL_PARSER_NAMES() if callable(TOOL_PARSER_NAMES) else TOOL_PARSER_NAMES)


def _reasoning_parser_names() -> list[str]:
    from ringllm.server.reasoning_parsers import REASONING_PARSER_NAMES

    names = REASONING_PARSER_NAMES
    return list(names() if callable(names) else names)


def output_parsing_from_args(args: argparse.Namespace) -> OutputParsing:
    """The chat outputs' parsers; ValueError (the server does not start) on a bad flag."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (which format?)")
    parsing = OutputParsing(
        args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice
    )
    parsing.check()
    return parsing


def _loader(args: argparse.Namespace, several: bool):
    """Starts one model's engine (blocking), with the server's limits and supervision."""
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

    limits = limits_from_args(args)
    standby = (not several) if args.engine_standby is None else args.engine_standby

    def load(config: EngineConfig) -> AsyncLLM:
        llm = AsyncLLM.from_config(
            config,
            multiprocess=args.engine_process,
            max_queued_outputs=limits.max_queued_outputs,
            max_queued_output_bytes=limits.max_queued_output_bytes,
            max_queued_output_bytes_total=limits.max_queued_output_bytes_total,
            busy_wait_s=limits.request_ring_wait_s,
            max_restarts=max(0, args.engine_restarts),
            restart_window_s=args.engine_restart_window_s,
            standby=standby,
        )
        try:
            llm.check_health()
        except BaseException:
            llm.shutdown()
            raise
        return llm

    return load


def _register_loras(router: ModelRouter, args: argparse.Namespace) -> None:
    """--lora-modules onto their models (loaded with them; SystemExit: a bad entry)."""
    try:
        for name, path, base in parse_lora_modules(args.lora_modules):
            router.register_lora(name, path, base)
    except ValueError as exc:
        raise SystemExit(f"ringllm serve: --lora-modules: {exc}") from None


async def _serve(config: EngineConfig, args: argparse.Namespace) -> None:
    limits = limits_from_args(args)
    parsing = output_parsing_from_args(args)
    specs, policy = model_specs(args, config), _policy(args)
    load = _loader(args, len(specs) > 1)
    if len(specs) == 1 and not policy.manages_sleep:
        # one model, as it always ran: named by what the engine loaded
        llm = load(config)
        name, aliases = served_model_name(llm, config.model.served_model_name, config.model.model)
        router = ModelRouter.of_one(llm, name, aliases)
    else:
        router = ModelRouter(specs, load, policy)
    runner = None
    try:
        _register_loras(router, args)
        try:
            await router.start()
        except ValueError as exc:  # an adapter of --lora-modules that does not fit
            raise SystemExit(f"ringllm serve: {exc}") from None
        allowed = allowed_host_names(args.host, args.allowed_hosts.split(","))
        app = create_app(
            router,
            None,
            args.api_key,
            args.max_body_bytes,
            limits,
            allowed,
            args.open_metrics,
            parsing=parsing,
        )
        # handler_cancellation: a client that disconnects cancels its handler, which
        # aborts its requests in the engine core (non-streaming requests included).
        runner = web.AppRunner(
            app, handler_cancellation=True, keepalive_timeout=args.keepalive_timeout_s
        )
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        host, port = runner.addresses[0][:2]
        freeze_heap()  # the server's start-up objects, out of every later collection's walk
        for hosted in router.hosted():
            print(f"ringllm serve: model {hosted.name!r}", flush=True)
            instance = getattr(hosted.llm and hosted.llm.client, "instance_name", None)
            if instance is not None:
                print(f"ringllm serve: engine IPC instance {instance}", flush=True)
        print(f"ringllm serve: listening on http://{host}:{port}", flush=True)
        hurry = await _wait_for_signal()
        await _drain(app, router, args.shutdown_timeout, hurry)
    finally:
        await router.stop()
        if runner is not None:
            await runner.cleanup()
        router.shutdown()


async def _wait_for_signal() -> asyncio.Event:
    """Waits for SIGINT / SIGTERM; returns the event the next one sets (hurry up)."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    await stop.wait()
    return hurry


async def _drain(app, router: ModelRouter, timeout_s: float, hurry: asyncio.Event) -> None:
    """Graceful shutdown: /health and new generation requests answer 503 from now; those
    in flight run to their end for up to `timeout_s`; what is left ends with an error
    (503 `server_shutting_down`, in-band on a stream), then the server goes."""
    from ringllm.server.app import DRAIN_KEY
    from ringllm.server.errors import ServerShuttingDownError

    drain = app[DRAIN_KEY]
    drain.start()
    logger.info("draining: %d requests in flight, up to %.0f s", drain.in_flight, timeout_s)
    if await drain.wait_idle(timeout_s, hurry):
        logger.info("drained; shutting down")
        return
    error = ServerShuttingDownError(
        f"the server shut down before this request finished (it waited {timeout_s:.0f} s "
        "for requests in flight); retry on another replica, or once it is back"
    )
    ended = sum(llm.fail_all(error) for llm in router.loaded())
    logger.info("ended %d unfinished engine requests; shutting down", ended)
    await drain.wait_idle(5.0)  # their handlers send the error and return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringllm serve", description=__doc__.splitlines()[0])
    configure_parser(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # a value the user gave: said as `ringllm serve` says it
        print(f"ringllm serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
