"""LoRA adapters on the server: `--lora-modules`, /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's routes and bodies), and the engine view a request for an
adapter is served through.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql",
                                   "base_model_name": "qwen"}     (the last: several models)
        200 text "Success: LoRA adapter 'sql' added successfully."
        400 the reason (not a PEFT folder, a rank above --max-lora-rank, an adapter for
            another base model, a name in use, LoRA not enabled)
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}
        200 text "Success: LoRA adapter 'sql' removed successfully."   404: no such adapter

Both need the API key like every route. An adapter is then a model of its own to the
API: its name in `model` runs the request on its base model with it, and /v1/models lists
it with its `parent`. The routes exist where a model was started with --enable-lora.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ringllm.pipeline.lora_request import LoRARequest
from ringllm.server.errors import ApiError
from ringllm.server.guards import read_json

if TYPE_CHECKING:
    from ringllm.server.model_router import ModelRouter


class LoraEngine:
    """An engine as a request for one adapter sees it: `generate` runs with the adapter;
    everything else is the base engine's."""

    def __init__(self, llm: Any, lora: LoRARequest) -> None:
        self._llm = llm
        self.lora = lora

    def generate(self, *args, **kwargs):
        return self._llm.generate(*args, lora_request=self.lora, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, vLLM's two spellings: `name=path`, or a JSON object
    {"name": ..., "path": ..., "base_model_name": ...}. (name, path, base model or None)."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not a JSON object ({exc})") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= set(spec):
                raise ValueError(f'--lora-modules {value!r}: a JSON entry needs "name" and "path"')
            modules.append((str(spec["name"]), str(spec["path"]), spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
        modules.append((name, path, None))
    return modules


def _field(body: Any, name: str, required: bool = True) -> str | None:
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(f"{name}: must be a non-empty string", param=name)
    return value


async def load_lora_adapter(request: web.Request, router: ModelRouter) -> web.Response:
    body = await read_json(request)
    name = _field(body, "lora_name")
    path = _field(body, "lora_path")
    base = _field(body, "base_model_name", required=False)
    await router.load_lora(name, path, base)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request, router: ModelRouter) -> web.Response:
    body = await read_json(request)
    name = _field(body, "lora_name")
    await router.unload_lora(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
