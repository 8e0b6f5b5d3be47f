"""Tool calling (perfx_core.tools): tools rendered through the chat template (or, for SmolLM2's template, which has
no tools, a system message), calls held to the tool choice by the grammar engine and parsed back into
``tool_calls``, whole and streamed, through the Python API and a real `perfx serve` with the official openai client."""

from __future__ import annotations

import json
import random
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from test_serving import client_and_model
from transformers.utils.chat_template_utils import render_jinja_template

from perfx_core.chat_template import render_chat, template_takes_tools
from perfx_core.tools import ToolCallStream, ToolSpecError, conversation_for_template, parse_tool_calls, tool_choice

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 30}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A finished exchange in OpenAI's wire format: the call's arguments are a JSON string.
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- parsing and rendering ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Plain text, with a < and a trailing newline\n",
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\nDone.',
        '<tool_call>\n{"name": "not_a_tool", "arguments": {}}\n</tool_call>',  # not offered: stays text
        '<tool_call>\n{"name": "search", "argu',  # cut off by max_tokens: stays text
    ],
)
def test_calls_parse_the_same_streamed_or_whole(text):
    content, calls = parse_tool_calls(text, TOOLS)
    rng = random.Random(0)
    for _ in range(20):
        stream, pieces, streamed = ToolCallStream(frozenset(SCHEMAS)), [], []
        pos = 0
        while pos < len(text):
            step = rng.randint(1, 12)
            piece, found = stream.push(text[pos : pos + step])
            pieces.append(piece)
            streamed += found
            pos += step
        pieces.append(stream.flush())
        assert "".join(pieces) == content
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    if "not_a_tool" in text or "argu" in text[-5:]:
        assert content == text and not calls


def test_tools_reach_a_template_without_them_as_a_system_message(smollm2):
    assert not template_takes_tools(smollm2.chat_template)
    text = smollm2.render_chat(HISTORY, tools=tool_choice(TOOLS, "auto"))
    system = text[: text.index("<|im_end|>")]
    for tool in TOOLS:  # each function's name, description and parameter schema
        assert json.dumps(tool["function"]["parameters"]) in system and tool["function"]["description"] in system
    assert "<tool_call>" in system and "You are a helpful AI assistant" not in text  # ours replaces the default
    # The earlier call and its result are in the conversation, in the same syntax.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


# A tool-use template of the kind Hugging Face models ship (tools listed in the system turn, calls and results in
# tags), written for this test.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif not (message.role == 'system' and tools) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_tool_template_renders_as_transformers_renders_it():
    assert template_takes_tools(TOOL_TEMPLATE)
    messages, tools = conversation_for_template(HISTORY, tool_choice(TOOLS, "auto"), native=True)
    ours = render_chat(TOOL_TEMPLATE, messages, tools=tools)
    hf_history = json.loads(json.dumps(HISTORY))
    hf_history[1]["content"] = ""
    call = hf_history[1]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])  # transformers' templates take the arguments as an object
    reference = render_jinja_template(
        conversations=[hf_history], tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=True
    )
    reference = reference[0][0] if isinstance(reference, tuple) else reference
    assert ours == reference
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in ours and "<tools>" in ours


def test_tool_choices_are_checked():
    assert tool_choice(TOOLS, "none") is None and tool_choice(None) is None and tool_choice([], "auto") is None
    named = tool_choice(TOOLS, {"type": "function", "function": {"name": "search"}}, False)
    assert (named.choice, named.name, named.parallel) == ("function", "search", False)
    for args, param in [
        ((TOOLS, {"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        ((TOOLS, "sometimes"), "tool_choice"),
        (([], "required"), "tool_choice"),
        (([{"type": "function", "function": {"name": "bad name!"}}],), "tools"),
        (([{"type": "retrieval"}],), "tools"),
        ((TOOLS + TOOLS[:1],), "tools"),
        ((TOOLS, "auto", "yes"), "parallel_tool_calls"),
    ]:
        with pytest.raises(ToolSpecError) as caught:
            tool_choice(*args)
        assert caught.value.param == param


# -- the Python API ---------------------------------------------------------------------------------------------


def test_python_api_chat_with_tools(smollm2):
    generation = smollm2.chat(
        ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=1.0, seed=2
    )
    content, calls = parse_tool_calls(generation.run(), TOOLS)
    # One whole call, and the generation ends with it (the grammar allows nothing more).
    assert content == "" and len(calls) == 1 and generation.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


# -- the server -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(grammar_server):
    return grammar_server


@pytest.fixture(scope="module")
def client(server):
    return client_and_model(server)


def test_required_and_named_choices(client):
    client, model = client
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=48
    )  # (greedy)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].id.startswith("call_")
    _check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}},
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=1.0,
        seed=5,
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["search"]
    _check_calls(named.choices[0].message.tool_calls)


class Place(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class GetWeather(BaseModel):
    """The weather at a place."""

    place: Place  # a nested model: its schema is a $ref into the tool's $defs
    unit: Literal["celsius", "fahrenheit"]


def test_sdk_parse_with_a_pydantic_tool(client):
    client, model = client
    completion = client.chat.completions.parse(
        model=model,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=1.0,
        seed=3,
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_streamed_tool_calls_equal_the_whole_response(client):
    client, model = client
    # Parallel calls allowed (the default): a call, then either more calls or the end.
    request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=42, temperature=0)
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]
    assert content == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    # Text held back while it may start a call is not streamed as empty chunks, one per token.
    said = [c for c in chunks[1:] if c.choices[0].delta.content or c.choices[0].delta.tool_calls]
    assert len(chunks) <= len(said) + 2  # the role chunk first, the finish_reason chunk last
    _check_calls(whole.message.tool_calls)


def test_auto_and_none(client):
    client, model = client
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0)
    message = auto.choices[0].message
    if message.tool_calls:  # auto: either valid calls or a message (which cannot start a call)
        _check_calls(message.tool_calls)
        assert auto.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert message.content and not message.content.startswith("<tool_call>")
    none = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None
    # "none" offers no tool: the prompt is the one without tools, and so is the reply.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_tool_calls_and_results_in_the_history_are_rendered(client, server):
    client, model = client
    ids = httpx.post(server.url + "/tokenize", json={"messages": HISTORY}, timeout=30).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "18 degrees, sunny" in text
    reply = client.chat.completions.create(model=model, messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0)
    asked = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens > asked.usage.prompt_tokens + 20


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_parameter(client, extra, param):
    client, model = client
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param


def test_bad_history_and_tools_on_completions_are_400(client, server):
    client, model = client
    broken = json.loads(json.dumps(HISTORY))
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=broken, max_tokens=4)
    assert caught.value.body["param"] == "messages"
    answer = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "tools": TOOLS, "max_tokens": 2}, timeout=30
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
