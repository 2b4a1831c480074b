"""Chat template rendering against transformers' apply_chat_template."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
import tok_fixtures as tf
from transformers import AutoTokenizer

from ringllm.pipeline.frontend.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    normalize_messages,
    read_template_override,
)

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Exercises tojson (HF's: no HTML escaping, indent), loopcontrols, {% generation %},
# template kwargs and tool calls whose arguments the template indexes as a dict.
TOOLS_TEMPLATE = """
{%- if tools %}
<tools>
{% for tool in tools %}{{ tool | tojson }}
{{ tool | tojson(indent=2) }}
{% endfor %}
</tools>
{% endif %}
{% for message in messages %}
  {% if message.content == 'BREAK' %}{% break %}{% endif %}
  <|im_start|>{{ message.role }}
  {% if message.role == 'assistant' %}{% generation %}{{ message.content or '' }}{% endgeneration %}
    {% for call in message.tool_calls or [] %}
<call>{{ call.function.name }}({{ call.function.arguments.city }})</call>
    {% endfor %}
  {% else %}{{ message.content }}{% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Café? 你好 🎉"},
        {"role": "assistant", "content": "  Oui.  "},
        {"role": "user", "content": "And <b>&</b>?"},
    ],
    [
        {"role": "developer", "content": "Be careful."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>& région</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _folder(tmp_path, template, **config):
    config.setdefault("bos_token", "<|endoftext|>")
    return tf.chatml_folder(tmp_path, chat_template=template, **config)


def _oracle(folder, messages, **kwargs):
    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, **kwargs
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers(tmp_path, add_generation_prompt):
    folder = _folder(tmp_path, tf.CHATML_TEMPLATE)
    template = ChatTemplate.from_folder(folder)
    for messages in CONVERSATIONS:
        ours = template.render(messages, add_generation_prompt=add_generation_prompt)
        assert ours == _oracle(folder, messages, add_generation_prompt=add_generation_prompt)


def test_special_tokens_and_raise_exception(tmp_path):
    folder = _folder(tmp_path, LLAMA2_TEMPLATE)
    template = ChatTemplate.from_folder(folder)
    messages = CONVERSATIONS[1][1:3]
    rendered = template.render(messages, add_generation_prompt=False)
    assert rendered == _oracle(folder, messages)
    assert rendered == "<|endoftext|>[INST] Café? 你好 🎉 [/INST] Oui. <|im_end|>"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(CONVERSATIONS[1][2:])


def test_tools_tojson_loopcontrols_generation_and_kwargs(tmp_path):
    folder = _folder(tmp_path, TOOLS_TEMPLATE)
    template = ChatTemplate.from_folder(folder)
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
    }
    messages = CONVERSATIONS[2] + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "BREAK"},
        {"role": "user", "content": "never rendered"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = template.render(
            messages, tools=TOOLS, add_generation_prompt=True, template_kwargs=kwargs
        )
        assert rendered == _oracle(
            folder, messages, tools=TOOLS, add_generation_prompt=True, **kwargs
        )
    assert '"Weather for a city <b>& région</b>"' in rendered  # not HTML-escaped
    assert "<call>get_weather(Zürich)</call>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n<think></think>")
    assert "never rendered" not in rendered


def test_openai_tool_call_arguments_string_is_parsed(tmp_path):
    template = ChatTemplate.from_folder(_folder(tmp_path, TOOLS_TEMPLATE))
    call = {"type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
    rendered = template.render([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert "<call>f(Oslo)</call>" in rendered
    call["function"]["arguments"] = "{oops"
    with pytest.raises(ChatTemplateError, match=r"tool_calls\[0\]\.function\.arguments: not valid"):
        template.render([{"role": "assistant", "content": "", "tool_calls": [call]}])


def test_named_templates_list_form(tmp_path):
    named = [
        {"name": "default", "template": tf.CHATML_TEMPLATE},
        {"name": "tool_use", "template": TOOLS_TEMPLATE},
    ]
    folder = _folder(tmp_path, named)
    template = ChatTemplate.from_folder(folder)
    assert template.template_names == ["default", "tool_use"]
    messages = CONVERSATIONS[0]
    assert template.render(messages) == _oracle(folder, messages, add_generation_prompt=True)
    with_tools = template.render(messages, tools=TOOLS)
    assert with_tools == _oracle(folder, messages, tools=TOOLS, add_generation_prompt=True)
    assert "<tools>" in with_tools
    assert template.render(messages, template_name="tool_use", tools=TOOLS) == with_tools
    with pytest.raises(ChatTemplateError, match=r"'nope' not found; this model has \['default'"):
        template.render(messages, template_name="nope")
    no_default = ChatTemplate({"a": tf.CHATML_TEMPLATE, "b": tf.CHATML_TEMPLATE})
    with pytest.raises(ChatTemplateError, match=r"several chat templates \['a', 'b'\]"):
        no_default.render(messages)


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    folder = _folder(tmp_path, LLAMA2_TEMPLATE)
    (folder / "chat_template.jinja").write_text(tf.CHATML_TEMPLATE)
    messages = CONVERSATIONS[1]
    rendered = ChatTemplate.from_folder(folder).render(messages)
    assert rendered == _oracle(folder, messages, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system")


def test_text_parts_are_flattened_and_other_parts_rejected(tmp_path):
    folder = _folder(tmp_path, tf.CHATML_TEMPLATE)
    template = ChatTemplate.from_folder(folder)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    rendered = template.render([{"role": "user", "content": parts}])
    assert rendered == _oracle(
        folder, [{"role": "user", "content": "first\nsecond"}], add_generation_prompt=True
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(
        ChatTemplateError, match=r"messages\[0\]\.content\[1\]: content part type 'image_url'"
    ):
        template.render([{"role": "user", "content": [parts[0], image]}])
    with pytest.raises(ChatTemplateError, match="needs a string 'text'"):
        template.render([{"role": "user", "content": [{"type": "text"}]}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: 'robot' is not one of system"),
        ([{"content": "x"}], r"messages\[0\]\.role: None"),
        (["hello"], r"messages\[0\]: must be an object"),
        ("hello", "messages: must be a list"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content: a user message needs"),
        ([{"role": "user"}], r"messages\[0\]\.content: a user message needs content"),
        ([{"role": "assistant", "content": None}], "only an assistant message with tool_calls"),
        ([{"role": "user", "content": [None]}], r"content\[0\]: a content part must be an object"),
    ],
)
def test_bad_messages_are_clear_errors(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        normalize_messages(messages)


def test_a_template_tripping_on_the_messages_shape_is_a_request_error():
    # the template sees the client's extra fields as given: an int where it adds strings
    template = ChatTemplate(
        "{% for m in messages %}{{ m['name'] + ': ' + m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="could not render the messages .TypeError"):
        template.render([{"role": "user", "name": 5, "content": "hi"}])


def test_sandbox_blocks_python_internals_and_mutation():
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escape.render(CONVERSATIONS[0])
    mutate = ChatTemplate(
        "{% set _ = messages.append({'role': 'system'}) %}{{ messages | length }}"
    )
    with pytest.raises(ChatTemplateError, match="chat template rejected the messages"):
        mutate.render(CONVERSATIONS[0])


def test_missing_and_broken_templates(tmp_path):
    folder = tf.write_hf_folder(tmp_path, tf.byte_level_bpe(), {"eos_token": "<|im_end|>"})
    with pytest.raises(ChatTemplateError, match=f"no chat template in {tmp_path}"):
        ChatTemplate.from_folder(folder)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}").render(CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="must be a string or a list"):
        ChatTemplate.from_folder(_folder(tmp_path, {"default": "x"}))


def test_strftime_now_and_continue_final_message(tmp_path):
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([], add_generation_prompt=False)
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)}
    folder = _folder(tmp_path, tf.CHATML_TEMPLATE)
    messages = CONVERSATIONS[0] + [{"role": "assistant", "content": "The answer is"}]
    rendered = ChatTemplate.from_folder(folder).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == _oracle(folder, messages, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ChatTemplate.from_folder(folder).render(messages, continue_final_message=True)


def test_tokenizer_config_special_tokens_reach_the_template(tmp_path):
    folder = _folder(tmp_path, "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate.from_folder(folder).render([])
    assert rendered == "<|endoftext|>|<|im_end|>|<|endoftext|>"


# ---- chat histories as agent frameworks send them --------------------------------------

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TIME_CALL = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
}
AGENT_HISTORIES = {
    # the openai client's own message object sent back: content null beside tool_calls
    "null content": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-18C"},
    ],
    # LangChain's shape: content absent, a tool message with a name
    "absent content, named tool": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "RESULT-18C"},
    ],
    # content as parts in every role, two calls and their two results in a row
    "parts everywhere, two results": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather and time in Paris?"}]},
        {"role": "assistant", "content": [], "tool_calls": [WEATHER_CALL, TIME_CALL]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "RESULT-18C"}],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "RESULT-9AM"},
    ],
}


def _agent_templates() -> dict[str, ChatTemplate]:
    from ringllm.pipeline.models.demo_model import demo_model_path

    return {
        "demo model's own": ChatTemplate.from_folder(demo_model_path()),
        "shipped hermes": ChatTemplate(read_template_override("hermes")),
    }


@pytest.mark.parametrize("history", sorted(AGENT_HISTORIES))
def test_agent_histories_render_in_every_template(history):
    """What the openai client, LangChain and the Agents SDK send back after a tool call
    renders in the demo model's own template (which concatenates content and knows no
    tools) and in the shipped tool template (which renders the calls): no 400."""
    messages = AGENT_HISTORIES[history]
    for name, template in _agent_templates().items():
        rendered = template.render(
            messages, tools=[{"type": "function", "function": {"name": "get_weather"}}]
        )
        assert "RESULT-18C" in rendered, name
        assert rendered.endswith("<|im_start|>assistant\n"), name
        if name == "shipped hermes":
            assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    if history == "parts everywhere, two results":
        hermes = _agent_templates()["shipped hermes"].render(messages)
        # two results in a row: one user turn holding both responses
        assert hermes.count("<tool_response>") == 2 and hermes.count("<|im_start|>user") == 2


def test_an_empty_tool_calls_list_does_not_excuse_null_content():
    with pytest.raises(ChatTemplateError, match="only an assistant message with tool_calls"):
        normalize_messages([{"role": "assistant", "content": None, "tool_calls": []}])
    with pytest.raises(ChatTemplateError, match="a tool message needs content"):
        normalize_messages([{"role": "tool", "tool_call_id": "call_1", "content": None}])
