"""Chat templates: OpenAI-style messages -> the prompt text the model was trained on.

A model folder carries its template as `chat_template.jinja` (preferred, as transformers
does) or as tokenizer_config.json's `chat_template`: one string, or a list of
`{"name", "template"}` entries (HF picks "tool_use" when tools are given, else "default").

Templates come from model folders, i.e. from strangers, so they run in jinja2's
`ImmutableSandboxedEnvironment`: no attribute access to Python internals, no mutation of
the messages. The environment matches what HF's `apply_chat_template` gives templates
(trim_blocks, lstrip_blocks, `loopcontrols`, the `{% generation %}` block, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`, and the special tokens as
variables), so a template renders here as it does in transformers.

Images (a model that takes them, `image_placeholder` given): a message with image parts
reaches a template that walks content lists (HF's multimodal ones) as a list of
`{"type": "text", "text"}` and `{"type": "image"}` parts in order; a template that only
renders string content gets vLLM's "string" form instead, the placeholder once per image
(less those the text already holds) before the message's text, newline-separated. Which
kind a template is, a probe rendering says once (`ChatTemplate.takes_content_lists`).

Invariants: messages reach the template as plain dicts whose `content` is a string (text
parts joined with newlines, as vLLM does; "" for an assistant's null content beside
`tool_calls`) or a list of parts (images, as above), never None;
every failure (bad message, template syntax error, `raise_exception`, sandbox violation)
is a `ChatTemplateError`, a `ValueError` whose text says what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from ringllm.pipeline.frontend.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    read_json_file,
    special_token_text,
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")
_TEMPLATE_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Content parts that carry an image: OpenAI's image_url (any caller), and a PIL image in
# "image" / "image_pil" (vLLM's offline LLM.chat).
IMAGE_PART_TYPES = ("image_url", "image", "image_pil")
_PROBE_TEXT = "ringllm-probe-7c1f"


class ChatTemplateError(ValueError):
    """Messages that cannot be rendered, or a template that cannot render them."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it; we only
    need the text, so the block renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja's own tojson HTML-escapes <, >, & and '; tool schemas must reach the
    # model verbatim, so this is json.dumps with HF's defaults.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# -- messages --------------------------------------------------------------------------


def content_parts(content: Any, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """A list content's parts with their field paths, each checked to be an object with a
    'type', and text parts to hold a string."""
    if not isinstance(content, Sequence) or isinstance(content, str):
        raise ChatTemplateError(
            f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
        )
    parts = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if not isinstance(part, Mapping) or "type" not in part:
            raise ChatTemplateError(f"{part_where}: a content part must be an object with a 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{part_where}: a 'text' part needs a string 'text' field")
        parts.append((part_where, part))
    return parts


def flatten_content(
    content: Any,
    where: str,
    image_placeholder: str | None = None,
    content_lists: bool = False,
) -> str | list[dict[str, str]] | None:
    """A message's content for the template: one string (text parts joined by newlines),
    or with images (`image_placeholder`: the model takes them) a list of text and image
    parts (`content_lists`) or vLLM's string form (placeholders, then the text)."""
    if content is None or isinstance(content, str):
        return content
    parts, num_images = [], 0
    for part_where, part in content_parts(content, where):
        kind = part["type"]
        if kind in IMAGE_PART_TYPES and image_placeholder is not None:
            parts.append({"type": "image"})
            num_images += 1
        elif kind == "text":
            parts.append({"type": "text", "text": part["text"]})
        else:
            if image_placeholder is not None:
                why = "only 'text' and 'image_url' parts are accepted"
            elif kind in IMAGE_PART_TYPES:
                why = "this model does not take images (it is text-only); send 'text' parts only"
            else:
                why = "this model is text-only, so only 'text' parts are accepted"
            raise ChatTemplateError(
                f"{part_where}: content part type {kind!r} is not supported; {why}"
            )
    text = "\n".join(part["text"] for part in parts if part["type"] == "text")
    if not num_images:
        return text
    if content_lists:
        return parts
    missing = max(0, num_images - text.count(image_placeholder))
    return "\n".join([image_placeholder] * missing + [text])


def image_parts(messages: Any) -> list[tuple[str, Mapping[str, Any] | Image.Image]]:
    """The images of a conversation in order: (field path, an image_url part or a PIL
    image). Malformed messages are skipped here: `normalize_messages` names them."""
    found: list[tuple[str, Mapping[str, Any] | Image.Image]] = []
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return found
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if content is None or isinstance(content, str):
            continue
        for part_where, part in content_parts(content, f"messages[{index}].content"):
            if part["type"] in IMAGE_PART_TYPES:
                found.append(_image_of_part(part, part_where))
    return found


def _image_of_part(part: Mapping[str, Any], where: str) -> tuple[str, Any]:
    kind = part["type"]
    if kind == "image_url":
        return f"{where}.image_url", part
    image = part.get(kind)
    if not isinstance(image, Image.Image):
        raise ChatTemplateError(
            f"{where}.{kind}: expected a PIL image (LLM.chat), got {type(image).__name__}; "
            "send an image as an 'image_url' part with a data: URL"
        )
    return f"{where}.{kind}", image


def _parse_tool_call_arguments(tool_calls: Any, where: str) -> Any:
    """Templates index `tool_call.function.arguments` as a dict; OpenAI sends a JSON string."""
    if not isinstance(tool_calls, list):
        return tool_calls
    parsed = []
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ChatTemplateError(
                    f"{where}.tool_calls[{index}].function.arguments: not valid JSON ({exc})"
                ) from exc
            except RecursionError:
                raise ChatTemplateError(
                    f"{where}.tool_calls[{index}].function.arguments: nests too deeply"
                ) from None
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def normalize_messages(
    messages: Any, image_placeholder: str | None = None, content_lists: bool = False
) -> list[dict[str, Any]]:
    """Check roles and flatten content (`flatten_content`'s image arguments); other fields
    (name, tool_calls, ...) pass through."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ChatTemplateError(
            f"messages: must be a list of messages, got {type(messages).__name__}"
        )
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where}: must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise ChatTemplateError(
                f"{where}.role: {role!r} is not one of {', '.join(MESSAGE_ROLES)}"
            )
        plain = dict(message)
        plain["content"] = flatten_content(
            message.get("content"), f"{where}.content", image_placeholder, content_lists
        )
        if plain["content"] is None:
            if not (role == "assistant" and message.get("tool_calls")):
                # OpenAI's rule: only an assistant message that makes tool calls may go
                # without content
                raise ChatTemplateError(
                    f"{where}.content: a {role} message needs content (a string or a list of "
                    "text parts); only an assistant message with tool_calls may omit it"
                )
            # NOTE: what the openai client and LangChain send back after a tool call
            # (content null or absent). Most templates concatenate content, and None fails
            # inside them; "" renders in every template, and one that tests `if content`
            # skips it as it would skip None.
            plain["content"] = ""
        if "tool_calls" in plain:
            plain["tool_calls"] = _parse_tool_call_arguments(plain["tool_calls"], where)
        normalized.append(plain)
    return normalized


# -- templates -------------------------------------------------------------------------


def _named_templates(raw: Any) -> str | dict[str, str]:
    """tokenizer_config.json's chat_template as a string or a {name: template} dict."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(
        isinstance(entry, Mapping)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
        for entry in raw
    ):
        return {entry["name"]: entry["template"] for entry in raw}
    raise ChatTemplateError(
        f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of "
        f"{{'name', 'template'}} objects, got {type(raw).__name__}"
    )


# Templates ringllm ships for models whose own knows no tools (--chat-template NAME).
SHIPPED_TEMPLATES = {"hermes": "tool_chat_hermes.jinja"}
_TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


def read_template_override(value: str) -> str:
    """--chat-template: a shipped template's name, else a path to a Jinja file."""
    if value in SHIPPED_TEMPLATES:
        return (_TEMPLATES_DIR / SHIPPED_TEMPLATES[value]).read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"chat_template: {value!r} is neither a file nor one of the shipped templates "
            f"({', '.join(SHIPPED_TEMPLATES)})"
        )
    return path.read_text(encoding="utf-8")


class ChatTemplate:
    """One model's chat template(s), compiled once, rendered per request."""

    def __init__(
        self, source: str | dict[str, str], special_tokens: Mapping[str, str | None] | None = None
    ) -> None:
        if isinstance(source, Mapping) and not source:
            raise ChatTemplateError("chat template: the list of named templates is empty")
        self.source = source
        self.special_tokens = (
            {field: special_tokens.get(field) for field in _TEMPLATE_TOKEN_FIELDS}
            if special_tokens
            else dict.fromkeys(_TEMPLATE_TOKEN_FIELDS)
        )
        self._env = _make_environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._takes_lists: dict[tuple[str, str], bool] = {}

    @classmethod
    def from_folder(cls, folder: str | Path, override: str | None = None) -> ChatTemplate:
        """The template of an HF folder: chat_template.jinja, else tokenizer_config.json's;
        `override` (--chat-template): a Jinja file, or the name of one ringllm ships."""
        folder = Path(folder)
        config = read_json_file(folder / TOKENIZER_CONFIG_FILE)
        special_tokens = {
            field: special_token_text(config.get(field)) for field in _TEMPLATE_TOKEN_FIELDS
        }
        if override:
            return cls(read_template_override(override), special_tokens)
        template_file = folder / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            return cls(template_file.read_text(encoding="utf-8"), special_tokens)
        if config.get("chat_template") is not None:
            return cls(_named_templates(config["chat_template"]), special_tokens)
        raise ChatTemplateError(
            f"no chat template in {folder}: neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' "
            f"in {TOKENIZER_CONFIG_FILE}; this model cannot serve chat requests unless a "
            "template is given explicitly"
        )

    @property
    def template_names(self) -> list[str]:
        return sorted(self.source) if isinstance(self.source, Mapping) else []

    def select(self, template_name: str | None = None, has_tools: bool = False) -> str:
        """The template text to use, chosen as transformers chooses it."""
        if not isinstance(self.source, Mapping):
            if template_name is not None:
                raise ChatTemplateError(
                    f"chat template {template_name!r} requested, but this model has only one, "
                    "unnamed"
                )
            return self.source
        if template_name is not None:
            if template_name not in self.source:
                raise ChatTemplateError(
                    f"chat template {template_name!r} not found; "
                    f"this model has {self.template_names}"
                )
            return self.source[template_name]
        if has_tools and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ChatTemplateError(
            f"this model has several chat templates {self.template_names} and none named "
            "'default'; name the one to use"
        )

    def _compile(self, text: str) -> jinja2.Template:
        if text not in self._compiled:
            try:
                self._compiled[text] = self._env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"chat template: syntax error at line {exc.lineno}: {exc.message}"
                ) from exc
        return self._compiled[text]

    def takes_content_lists(self, text: str, image_placeholder: str) -> bool:
        """Whether the template `text` renders list content with one placeholder per image
        part (HF's multimodal templates), judged once by rendering a probe message; a
        template that fails on it, or prints the list as it is, only takes strings."""
        key = (text, image_placeholder)
        if key not in self._takes_lists:
            probe = [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": _PROBE_TEXT}],
                }
            ]
            variables = dict(self.special_tokens, messages=probe, add_generation_prompt=False)
            try:
                rendered = self._compile(text).render(**variables)
            except Exception:  # the template's own failure: it does not take lists
                rendered = ""
            self._takes_lists[key] = (
                rendered.count(image_placeholder) == 1 and _PROBE_TEXT in rendered
            )
        return self._takes_lists[key]

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template_name: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        image_placeholder: str | None = None,
    ) -> str:
        """The prompt text for `messages`.

        `add_generation_prompt` appends the assistant turn's opening; with
        `continue_final_message` the text instead ends right after the last message's
        content, so the model continues it (the two are exclusive). `image_placeholder`:
        the model takes images, and this is its image token's text (None: image parts are
        refused).
        """
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "add_generation_prompt and continue_final_message cannot both be set: the first "
                "opens a new assistant turn, the second continues the last message"
            )
        text = self.select(template_name, has_tools=tools is not None)
        template = self._compile(text)
        content_lists = image_placeholder is not None and self.takes_content_lists(
            text, image_placeholder
        )
        plain_messages = normalize_messages(messages, image_placeholder, content_lists)
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(template_kwargs or {})
        variables.update(
            messages=plain_messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            rendered = template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # the template works on the client's messages (extra fields pass through as
            # given), so a template that trips on their shape is the request's fault
            raise ChatTemplateError(
                f"chat template could not render the messages ({type(exc).__name__}: {exc}); "
                "check the fields of each message"
            ) from exc
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, plain_messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Drop what the template puts after the last message's content (its end-of-turn)."""
    final_text = _final_text(messages[-1]["content"]) if messages else None
    if not final_text:
        raise ChatTemplateError("continue_final_message: the last message has no text to continue")
    for candidate in (final_text, final_text.strip()):
        end = rendered.rfind(candidate)
        if end >= 0:
            return rendered[: end + len(candidate)]
    raise ChatTemplateError(
        "continue_final_message: the template does not render the last message's text verbatim"
    )


def _final_text(content: str | list[dict[str, str]] | None) -> str | None:
    """The text a message's rendering ends with: its content, or its last text part."""
    if not isinstance(content, list):
        return content
    texts = [part["text"] for part in content if part["type"] == "text"]
    return texts[-1] if texts else None
