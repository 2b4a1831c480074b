"""The request fields that constrain an output: structured outputs and tools.

    response_format      {"type": "text" | "json_object" | "json_schema", "json_schema":
                         {"name", "schema", "strict", "description"}}     (OpenAI; both endpoints)
    structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar            (vLLM's older names)
    tools, tool_choice, parallel_tool_calls                              (OpenAI; chat only)

At most one of the first three kinds may be given. `tool_choice` "required" or a named
function is enforced with a grammar too (`ToolRequest.structured_outputs`): "required"
constrains the output to a JSON array of `{"name", "parameters"}` objects, one per call,
each valid against its tool's `parameters` schema; a named function constrains it to that
function's arguments. Such a tool_choice together with a response_format is a conflict (a
400). "auto" needs the server's `--enable-auto-tool-choice` and `--tool-call-parser`.
Every problem is a 400 naming the field.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ringllm.pipeline.structured.grammar import check_json_schema
from ringllm.pipeline.structured.params import StructuredOutputsParams
from ringllm.server.errors import ApiError

STRUCTURED_FIELDS = {
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
_BACKENDS = {"auto", "guidance", "llguidance"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def parse_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The output constraint of a request body (None: unconstrained)."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    raw = body.get("structured_outputs")
    if raw is not None:
        found.append(("structured_outputs", _structured_object(raw)))
    guided = {kind: body[name] for name, kind in _GUIDED.items() if name in body}
    if guided:
        found.append((", ".join(n for n in _GUIDED if n in body), guided))
    backend = body.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend not in _BACKENDS):
        raise ApiError(
            f"guided_decoding_backend: {backend!r} is not one this server has "
            f"({', '.join(sorted(_BACKENDS))}: all llguidance)",
            param="guided_decoding_backend",
        )
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(
            f"{found[0][0]}: give one output constraint; this request has "
            f"{' and '.join(name for name, _ in found)}",
            param=found[0][0],
        )
    if len(found[0][1]) != 1:
        name = found[0][0]
        raise ApiError(
            f"{name}: give exactly one of json, json_object, regex, choice, grammar; got "
            f"{', '.join(found[0][1]) or 'none'}",
            param=name.split(",")[0],
        )
    name, spec = found[0]
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as exc:
        raise ApiError(f"{name}: {_tail(exc)}", param=name.split(",")[0]) from None


def _tail(exc: Exception) -> str:
    text = str(exc)
    return (
        text.split(": ", 1)[1] if text.startswith("structured_outputs") and ": " in text else text
    )


def _response_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ApiError(
            "response_format: must be an object with a 'type' (text, json_object, json_schema)",
            param="response_format",
        )
    kind = raw["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError(
                "response_format.json_schema: must be an object with a non-empty 'name' and "
                "a 'schema'",
                param="response_format",
            )
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ApiError(
                f"response_format.json_schema: unknown field(s) {sorted(unknown)}",
                param="response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ApiError(
                "response_format.json_schema.schema: must be a JSON Schema object",
                param="response_format",
            )
        return {"json": schema}
    raise ApiError(
        f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
        param="response_format",
    )


def _structured_object(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ApiError(
            "structured_outputs: must be an object with one of json, regex, choice, grammar, "
            "json_object",
            param="structured_outputs",
        )
    unknown = set(raw) - _STRUCTURED_KEYS - {"disable_any_whitespace", "backend"}
    if unknown:
        raise ApiError(
            f"structured_outputs: unknown field(s) {sorted(unknown)}; known: "
            f"{', '.join(sorted(_STRUCTURED_KEYS))}",
            param="structured_outputs",
        )
    return {k: v for k, v in raw.items() if k in _STRUCTURED_KEYS and v is not None}


# ---- tools -------------------------------------------------------------------------------


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # as the client sent them (validated): the template's input
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    schemas: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema

    @functools.cached_property
    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar a required or named tool_choice is enforced with; ApiError (400) if
        it is past what a spec may be (its tools' schemas together, for "required")."""
        try:
            return self._structured_outputs()
        except ValueError as exc:
            what = f"function {self.named!r}" if self.mode == "named" else "the tools"
            raise ApiError(
                f"tool_choice: {self.mode} is enforced with a grammar built from {what}, and "
                f'it cannot be: {exc}; send fewer or smaller tools, or tool_choice "auto"',
                param="tool_choice",
            ) from None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.schemas[self.named])
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)


def parse_tools(body: dict[str, Any], auto_tool_choice: bool) -> ToolRequest | None:
    """`tools` / `tool_choice` / `parallel_tool_calls` of a chat body (None: no tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError("parallel_tool_calls: must be true or false", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError(
                f"tool_choice: {_short(choice)} needs tools; the request has none",
                param="tool_choice",
            )
        return None
    if not isinstance(tools, list):
        raise ApiError("tools: must be a list of tools", param="tools")
    schemas = {}
    for index, tool in enumerate(tools):
        name, schema = _tool(tool, index)
        if name in schemas:
            raise ApiError(f"tools[{index}].function.name: {name!r} is given twice", param="tools")
        schemas[name] = schema
    request = ToolRequest(tools, "none", parallel=parallel, schemas=schemas)
    if choice is None:
        request.mode = "auto" if auto_tool_choice else "none"
    elif choice in ("none", "required"):
        request.mode = choice
    elif choice == "auto":
        if not auto_tool_choice:
            raise ApiError(
                'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser; "none", "required" or a named function work without',
                param="tool_choice",
            )
        request.mode = "auto"
    else:
        request.mode, request.named = "named", _named_choice(choice, schemas)
    request.structured_outputs  # noqa: B018 (built now: past its limit, a 400 at once)
    # the slow part, last (pure Python, milliseconds a schema): the caller runs it off the loop
    for index, schema in enumerate(schemas.values()):
        try:
            check_json_schema(schema, f"tools[{index}].function.parameters")
        except ValueError as exc:
            raise ApiError(str(exc), param="tools") from None
    return request


def _tool(tool: Any, index: int) -> tuple[str, dict]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(
            f'{where}: must be {{"type": "function", "function": {{...}}}}', param="tools"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(f"{where}.function: must be an object with a name", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ApiError(
            f"{where}.function.name: {_short(name)} is not a function name (1-64 of a-z, A-Z, "
            "0-9, _ and -)",
            param="tools",
        )
    schema = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise ApiError(f"{where}.function.parameters: must be a JSON Schema object", param="tools")
    return name, schema


def _named_choice(choice: Any, schemas: dict[str, dict]) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ApiError(
            'tool_choice: must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {_short(choice)}',
            param="tool_choice",
        )
    if name not in schemas:
        raise ApiError(
            f"tool_choice: function {name!r} is not in tools ({', '.join(schemas)})",
            param="tool_choice",
        )
    return name


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
