"""Several base models behind one server: which engine serves a request, and which sleep.

`ringllm serve --model A --model B ...` (or `--models-dir DIR`) hosts one engine core per
model (each an `AsyncLLM` with its own core process, rings and tokenizer child). A request
is routed by its `model` field (none: the first model). One model, as `ringllm serve MODEL`
runs it, is a router of one that never sleeps by itself.

A hosted model's states, and what moves it:

    unloaded --load--> awake --sleep (idle, or to make room)--> asleep --wake--> awake
                         ^                                                  |
                         '--------------------------------------------------'

- A request to an awake model counts itself in `users` at once: no await falls between
  the check and the count, so nothing can put it to sleep under that request.
- Transitions (load, wake, sleep) run one at a time, under the router's lock. The sleeper
  checks `users` and the engine's unfinished requests under that lock and marks the model
  `falling asleep` before it awaits the engine, so a request that comes meanwhile takes the
  slow path: it waits for the lock, then wakes the model. A request is never refused
  because its model sleeps; it waits for the wake (and for the load the first time).
- Memory. Each model's resident size is measured (the RSS of its core process and that
  process's children) after every load, wake and sleep; before its first load it is
  estimated from its weight files, its KV-cache budget and a process's base. Before a load
  or wake, idle awake models are put to sleep, least recently used first, until the
  awake ones fit `max_awake` and the sum of every model's resident size fits
  `memory_bytes`. When no awake model is idle, the least recently used one drains: its
  requests under way run to their end, new ones wait for its next wake (so a model kept
  busy cannot starve the others), then it sleeps. When every other model already sleeps,
  the request goes ahead (nothing more can be given back).
- Idle models sleep by themselves after `idle_s` with no request (level `sleep_level`:
  1 keeps the weights in a file, 2 drops them and loads them again on the wake).
- LoRA adapters belong to a model (`HostedModel.loras`, by name; --lora-modules or
  /v1/load_lora_adapter). A request naming an adapter is served by its model, with it;
  the model loads its adapters when it loads (a sleep keeps them). Adapter names are
  unique across the server and never a model's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.lora_request import LoRARequest
from ringllm.server.errors import NOT_FOUND, ApiError

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# A fresh engine core process before its model: the interpreter, torch and the engine
# imported (measured on the demo model: 280-330 MB; a round figure above it).
CORE_PROCESS_BASE_BYTES = 400 << 20
# The engine's KV-cache budget on a CPU when none is given (worker/model_runner.py).
CPU_DEFAULT_KV_BYTES = 1 << 30
# How often the sleeper looks for idle models, at most (and at least: idle_s / 4).
SLEEPER_PERIOD_S = 1.0
# How often a request that waits for room looks again.
ROOM_POLL_S = 0.05


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    AWAKE = "awake"
    DRAINING = "draining"  # to sleep once its requests end; new ones wait for its wake
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"


@dataclass(frozen=True)
class ModelSpec:
    """One model the server hosts: the name the API shows, the other names a request may
    use, and its engine config."""

    name: str
    config: EngineConfig
    aliases: frozenset[str] = frozenset()


@dataclass
class HostedModel:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    llm: AsyncLLM | None = None
    serving: object | None = None  # server.serving.Serving, made once the engine is up
    users: int = 0
    last_used_s: float = field(default_factory=time.monotonic)
    resident_bytes: int = 0  # measured (or estimated before the first load)
    awake_bytes: int = 0  # its size awake, as last measured (estimated until then)
    num_wakes: int = 0
    last_wake_s: float | None = None  # how long the last load or wake took
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # its adapters, by name

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.users > 0 or (self.llm is not None and self.llm.num_unfinished_requests > 0)

    def card(self) -> dict:
        """What /v1/models says of it (never a path of this machine)."""
        level = self.llm.sleep_level if self.llm is not None else 0
        return {
            "state": self.state.value,
            "sleep_level": level,
            "resident_bytes": self.resident_bytes,
            "last_wake_s": None if self.last_wake_s is None else round(self.last_wake_s, 3),
        }


@dataclass(frozen=True)
class RouterPolicy:
    """`idle_s`: a model with no request for this long sleeps (None: never by itself);
    `sleep_level`: 1 or 2; `memory_bytes`: the resident size of every model together (None:
    no budget); `max_awake`: models awake at once (None: no limit)."""

    idle_s: float | None = None
    sleep_level: int = 1
    memory_bytes: int | None = None
    max_awake: int | None = None

    def __post_init__(self) -> None:
        if self.idle_s is not None and not self.idle_s > 0:
            raise ValueError(f"model idle time: must be above 0 s, got {self.idle_s}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"model sleep level: must be 1 or 2, got {self.sleep_level}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"models memory: must be >= 1 byte, got {self.memory_bytes}")
        if self.max_awake is not None and self.max_awake < 1:
            raise ValueError(f"models awake at once: must be >= 1, got {self.max_awake}")

    @property
    def manages_sleep(self) -> bool:
        return (
            self.idle_s is not None or self.memory_bytes is not None or self.max_awake is not None
        )


Loader = Callable[[EngineConfig], "AsyncLLM"]
ServingFactory = Callable[["AsyncLLM", str], object]


class ModelRouter:
    """The models one server hosts; `use(name)` hands out a model's `Serving` once it is
    awake. `load` builds an engine (blocking: it runs on a worker thread); `make_serving`
    wraps one for the HTTP handlers."""

    def __init__(
        self,
        specs: list[ModelSpec],
        load: Loader,
        policy: RouterPolicy | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a server needs at least one model")
        names: dict[str, str] = {}
        for index, spec in enumerate(specs):
            if any(spec.name == other.name for other in specs[:index]):
                raise ValueError(
                    f"model name {spec.name!r} is given to two models; name them apart "
                    "(--model NAME=PATH)"
                )
            for key in (spec.name, *spec.aliases):
                if key in names and names[key] != spec.name:
                    raise ValueError(
                        f"model name {key!r} is given to two models ({names[key]!r} and "
                        f"{spec.name!r}); name them apart (--model NAME=PATH)"
                    )
                names[key] = spec.name
        self.models = {spec.name: HostedModel(spec) for spec in specs}
        self._by_name = {key: self.models[name] for key, name in names.items()}
        self.default = self.models[specs[0].name]
        self.policy = policy or RouterPolicy()
        self._load = load
        self._make_serving: ServingFactory | None = None
        self._lock = asyncio.Lock()
        self._lora_lock = asyncio.Lock()  # one adapter load or unload at a time
        self._lora_ids = 0  # the last adapter id given (never reused)
        self._sleeper: asyncio.Task | None = None
        for hosted in self.models.values():
            hosted.awake_bytes = estimate_bytes(hosted.spec.config)

    @classmethod
    def of_one(cls, llm: AsyncLLM, name: str, aliases: frozenset[str] = frozenset()) -> ModelRouter:
        """A router of one engine already running (never sleeps by itself)."""
        router = cls([ModelSpec(name, llm.config, aliases)], _no_loader)
        hosted = router.default
        hosted.llm, hosted.state = llm, ModelState.AWAKE
        return router

    @property
    def multi(self) -> bool:
        return len(self.models) > 1

    def hosted(self) -> list[HostedModel]:
        return list(self.models.values())

    def loaded(self) -> list[AsyncLLM]:
        return [h.llm for h in self.models.values() if h.llm is not None]

    # ---- life ------------------------------------------------------------------------

    def bind(self, make_serving: ServingFactory) -> None:
        """Makes the handlers' `Serving` of each engine (the app's, once it exists)."""
        self._make_serving = make_serving
        for hosted in self.models.values():
            if hosted.llm is not None and hosted.serving is None:
                hosted.serving = make_serving(hosted.llm, hosted.name)

    async def start(self) -> None:
        """Loads the first model (the others load on their first request) and starts the
        sleeper where the policy has models sleep."""
        if self.default.llm is None:
            async with self._lock:
                await self._make_room(self.default)
                await self._bring_up(self.default, strict=True)
        else:  # a router of one engine already running: its adapters now
            await self._load_loras(self.default, strict=True)
        if self.policy.idle_s is not None and self._sleeper is None:
            self._sleeper = asyncio.create_task(self._sleep_idle_models())

    async def stop(self) -> None:
        if self._sleeper is not None:
            self._sleeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sleeper
            self._sleeper = None

    def shutdown(self) -> None:
        """Every engine down (their processes and shared memory)."""
        for hosted in self.models.values():
            if hosted.llm is not None:
                hosted.llm.shutdown()

    # ---- requests --------------------------------------------------------------------

    def lookup(self, name: str | None) -> HostedModel:
        """The model a request names (None: the first); 404 `model_not_found` if none."""
        return self.resolve(name, adapters=False)[0]

    def resolve(
        self, name: str | None, adapters: bool = True
    ) -> tuple[HostedModel, LoRARequest | None]:
        """The model a request names and the adapter (None: the base model), by a model's
        name or alias or an adapter's name; 404 `model_not_found` if none."""
        if name is None:
            return self.default, None
        if not isinstance(name, str):
            raise ApiError(f"model: must be a string, got {type(name).__name__}", param="model")
        hosted = self._by_name.get(name)
        if hosted is not None:
            return hosted, None
        for owner in self.models.values() if adapters else ():
            if name in owner.loras:
                return owner, owner.loras[name]
        served = ", ".join(repr(n) for n in [*self.models, *self.adapter_names()])
        raise ApiError(
            f"model: {name!r} does not exist here; this server serves {served}",
            status=HTTPStatus.NOT_FOUND,
            param="model",
            error_type=NOT_FOUND,
            code="model_not_found",
        )

    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[object]:
        """The named model's `Serving`, awake, for as long as the block runs; an adapter's
        name: its model's, whose requests run with that adapter."""
        hosted, lora = self.resolve(name)
        if hosted.state is not ModelState.AWAKE and self.policy_wakes(hosted):
            await self._bring_awake(hosted)
        hosted.users += 1
        hosted.last_used_s = time.monotonic()
        try:
            yield hosted.serving if lora is None else hosted.serving.with_lora(lora)
        finally:
            hosted.users -= 1
            hosted.last_used_s = time.monotonic()

    def policy_wakes(self, hosted: HostedModel) -> bool:
        """Whether a request wakes its model. A router of one that manages no sleep leaves
        a model put to sleep by /sleep asleep (its requests: 503 engine_sleeping), as the
        single-model server always did."""
        return self.multi or self.policy.manages_sleep or hosted.llm is None

    async def sleep_model(self, hosted: HostedModel, level: int) -> None:
        """/sleep: the model to sleep at `level` now (an unloaded one has nothing to give
        back). ValueError: the engine refused or failed, and is awake."""
        async with self._lock:
            if hosted.llm is not None:
                await self._put_to_sleep(hosted, level)

    async def wake_model(self, hosted: HostedModel, tags: list[str] | None = None) -> None:
        """/wake_up: the model awake (`tags`: only those parts, vLLM's; it stays asleep
        until every part is back); an unloaded one is loaded."""
        async with self._lock:
            if hosted.llm is None or tags is None:
                await self._make_room(hosted)
            if hosted.llm is None:
                await self._bring_up(hosted)
                return
            await hosted.llm.wake_up(tags)
            awake = not hosted.llm.is_sleeping()
            hosted.state = ModelState.AWAKE if awake else ModelState.ASLEEP
            hosted.last_used_s = time.monotonic()
            self._measure(hosted, awake=awake)

    async def _bring_awake(self, hosted: HostedModel) -> None:
        """Loads or wakes the model for a request; a 503 `model_unavailable` (and the
        other models serve on) when its engine would not start or wake."""
        async with self._lock:
            # the users count goes up after this returns: on the loop, with nothing between
            while hosted.state is not ModelState.AWAKE:
                await self._make_room(hosted)
                try:
                    await self._bring_up(hosted)
                except Exception as exc:  # noqa: BLE001 - said to the client, logged here
                    logger.error("model %r could not be brought up: %s", hosted.name, exc)
                    raise ApiError(
                        f"model {hosted.name!r} could not be {_verb(hosted)}: {exc}",
                        status=HTTPStatus.SERVICE_UNAVAILABLE,
                        error_type="server_error",
                        code="model_unavailable",
                    ) from None

    # ---- transitions (under the lock) ------------------------------------------------

    # ---- LoRA adapters ----------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        return [name for hosted in self.models.values() for name in hosted.loras]

    def register_lora(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        """An adapter of model `base` (None: the first), loaded with its model (or at
        `start` for a model running already); ValueError for a name in use."""
        hosted = self._owner_for(name, base)
        self._lora_ids += 1
        lora = LoRARequest(name, self._lora_ids, path, hosted.name)
        hosted.loras[name] = lora
        return lora

    async def load_lora(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        """/v1/load_lora_adapter: the adapter loaded in its model's engine now (the model
        woken or loaded for it); ApiError 400 with the reason when it does not fit."""
        async with self._lora_lock:
            try:
                hosted = self._owner_for(name, base)
            except ValueError as exc:
                raise ApiError(str(exc), param="lora_name") from None
            self._lora_ids += 1
            lora = LoRARequest(name, self._lora_ids, path, hosted.name)
            async with self.use(hosted.name) as serving:
                try:
                    await serving.llm.add_lora(lora)
                except ValueError as exc:
                    raise ApiError(f"loading LoRA adapter {name!r} failed: {exc}") from None
            hosted.loras[name] = lora
            return lora

    async def unload_lora(self, name: str) -> LoRARequest:
        """/v1/unload_lora_adapter; 404 for an adapter not loaded, 400 while requests that
        run with it are under way."""
        async with self._lora_lock:
            owner = next((h for h in self.models.values() if name in h.loras), None)
            if owner is None:
                raise ApiError(
                    f"the LoRA adapter {name!r} cannot be found",
                    status=HTTPStatus.NOT_FOUND,
                    param="lora_name",
                    error_type=NOT_FOUND,
                    code="lora_not_found",
                )
            lora = owner.loras[name]
            if owner.llm is not None:
                try:
                    await owner.llm.remove_lora(lora.lora_int_id)
                except ValueError as exc:
                    raise ApiError(f"unloading LoRA adapter {name!r} failed: {exc}") from None
            del owner.loras[name]
            return lora

    def _owner_for(self, name: str, base: str | None) -> HostedModel:
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name: must be a non-empty string")
        if name in self._by_name or name in self.adapter_names():
            raise ValueError(f"the name {name!r} is taken (a model or a LoRA adapter)")
        hosted = self.models.get(base) if base is not None else self.default
        if hosted is None:
            raise ValueError(f"base_model_name: {base!r} is not a model this server serves")
        if not hosted.spec.config.lora.enable_lora:
            raise ValueError(
                f"model {hosted.name!r} takes no LoRA adapters; start the server with --enable-lora"
            )
        return hosted

    async def _load_loras(self, hosted: HostedModel, strict: bool = False) -> None:
        """The model's adapters into its engine (just loaded, or running already).
        `strict`: an adapter that fails stops the start; else it is dropped and logged."""
        for name, lora in list(hosted.loras.items()):
            try:
                await hosted.llm.add_lora(lora)
            except ValueError as exc:
                if strict:
                    raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
                logger.error("model %r: LoRA adapter %r dropped: %s", hosted.name, name, exc)
                del hosted.loras[name]

    async def _bring_up(self, hosted: HostedModel, strict: bool = False) -> None:
        started = time.monotonic()
        if hosted.llm is None:
            hosted.state = ModelState.LOADING
            logger.info("loading model %r", hosted.name)
            try:
                llm = await asyncio.get_running_loop().run_in_executor(
                    None, self._load, hosted.spec.config
                )
            except BaseException:
                hosted.state = ModelState.UNLOADED
                raise
            hosted.llm = llm
            if self._make_serving is not None:
                hosted.serving = self._make_serving(llm, hosted.name)
            await self._load_loras(hosted, strict)
        elif hosted.llm.is_sleeping():
            hosted.state = ModelState.WAKING
            logger.info("waking model %r (sleep level %d)", hosted.name, hosted.llm.sleep_level)
            try:
                await hosted.llm.wake_up()
            except BaseException:
                hosted.state = ModelState.ASLEEP
                raise
        hosted.state = ModelState.AWAKE
        hosted.last_wake_s = time.monotonic() - started
        hosted.num_wakes += 1
        hosted.last_used_s = time.monotonic()
        self._measure(hosted, awake=True)
        logger.info(
            "model %r awake in %.2f s (%.0f MB resident)",
            hosted.name,
            hosted.last_wake_s,
            hosted.resident_bytes / 1e6,
        )

    async def _put_to_sleep(self, hosted: HostedModel, level: int | None = None) -> None:
        level = level or self.policy.sleep_level
        hosted.state = ModelState.FALLING_ASLEEP
        logger.info("model %r sleeps (level %d)", hosted.name, level)
        try:
            await hosted.llm.sleep(level)
        except BaseException:
            hosted.state = ModelState.AWAKE  # the engine refused or failed: it is awake
            hosted.last_used_s = time.monotonic()
            raise
        hosted.state = ModelState.ASLEEP
        self._measure(hosted, awake=False)

    async def _make_room(self, waking: HostedModel) -> None:
        """Idle awake models to sleep, least recently used first, until `waking` fits."""
        while self._short_of_room(waking):
            others = [
                h for h in self.models.values() if h is not waking and h.state is ModelState.AWAKE
            ]
            if not others:
                return  # every other model sleeps: nothing more to give back
            # an idle one if there is one, else the least recently used drains: its
            # requests under way end, new ones wait (so a busy model cannot starve this one)
            victim = min([h for h in others if not h.busy] or others, key=lambda h: h.last_used_s)
            if victim.busy:
                victim.state = ModelState.DRAINING
                while victim.busy:
                    await asyncio.sleep(ROOM_POLL_S)
            try:
                await self._put_to_sleep(victim)
            except ValueError as exc:
                logger.warning("model %r could not sleep to make room: %s", victim.name, exc)
                return

    def _short_of_room(self, waking: HostedModel) -> bool:
        awake = [h for h in self.models.values() if h.state is ModelState.AWAKE and h is not waking]
        if self.policy.max_awake is not None and len(awake) + 1 > self.policy.max_awake:
            return True
        if self.policy.memory_bytes is None:
            return False
        others = sum(h.resident_bytes for h in self.models.values() if h is not waking)
        return others + waking.awake_bytes > self.policy.memory_bytes

    def _measure(self, hosted: HostedModel, awake: bool) -> None:
        pid = getattr(hosted.llm.client, "engine_pid", None) if hosted.llm else None
        measured = process_tree_rss(pid) if pid else None
        if measured is None:  # the core runs in this process: the estimate stands
            measured = hosted.awake_bytes if awake else CORE_PROCESS_BASE_BYTES
        hosted.resident_bytes = measured
        if awake:
            hosted.awake_bytes = measured

    # ---- the sleeper -----------------------------------------------------------------

    async def _sleep_idle_models(self) -> None:
        period = min(SLEEPER_PERIOD_S, self.policy.idle_s / 4)
        while True:
            await asyncio.sleep(period)
            for hosted in self.models.values():
                if self._is_idle(hosted):
                    async with self._lock:
                        if self._is_idle(hosted):  # looked at again under the lock
                            try:
                                await self._put_to_sleep(hosted)
                            except Exception as exc:  # noqa: BLE001 - it stays awake
                                logger.warning("model %r did not sleep: %s", hosted.name, exc)

    def _is_idle(self, hosted: HostedModel) -> bool:
        return (
            hosted.state is ModelState.AWAKE
            and not hosted.busy
            and time.monotonic() - hosted.last_used_s >= self.policy.idle_s
        )


def _verb(hosted: HostedModel) -> str:
    return "loaded" if hosted.llm is None else "woken"


def _no_loader(config: EngineConfig) -> AsyncLLM:
    raise RuntimeError("this router's model was given running; it has no loader")


def estimate_bytes(config: EngineConfig) -> int:
    """A model's resident size awake before it was ever measured: its weight files, its
    KV-cache budget and a core process's base."""
    kv_bytes = config.cache.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
    return weight_file_bytes(config.model.model) + kv_bytes + CORE_PROCESS_BASE_BYTES


def weight_file_bytes(model: str | None) -> int:
    if model is None:
        return 0
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin")]
    return sum(p.stat().st_size for p in files)


def process_tree_rss(pid: int) -> int | None:
    """The resident bytes of process `pid` and its descendants (None: it is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo, seen = 0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        rss = _rss_bytes(current)
        if rss is None:
            if current == pid:
                return None
            continue
        total += rss
        todo.extend(children.get(current, ()))
    return total


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def with_model(config: EngineConfig, model: str, sleep: bool) -> EngineConfig:
    """`config` for another model (and sleep mode on where the router has models sleep)."""
    model_config = dataclasses.replace(
        config.model,
        model=model,
        served_model_name=None,
        enable_sleep_mode=config.model.enable_sleep_mode or sleep,
    )
    return dataclasses.replace(config, model=model_config)
