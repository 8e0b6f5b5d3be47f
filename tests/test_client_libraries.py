"""Third-party OpenAI clients against a real `perfx serve`: litellm and langchain-openai, for plain chat, tool
calls (whole and streamed) and structured output. SmolLM2-135M is too small to choose well, so every structured
request is held by the grammar (tool_choice required or named, one call; a closed JSON schema) and the checks are
on the shapes the clients build: parsed arguments and objects that validate against their schemas, and streams
that assemble to the whole response."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from test_serving import client_and_model
from test_structured_output import PERSON, PERSON_CHAT, Person
from test_tools import ASK, SCHEMAS, TOOLS

# litellm fetches its model price list from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

litellm.suppress_debug_info = True  # its "Provider List" banner on every unknown model name
SEARCH_CHOICE = {"type": "function", "function": {"name": "search"}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server(grammar_server):
    return grammar_server


@pytest.fixture(scope="module")
def model(server):
    return client_and_model(server)[1]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI-shaped tool calls, each validated against its tool's parameter schema."""
    out = []
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _lc_calls(message) -> list[tuple[str, dict]]:
    """langchain's parsed tool calls (args already a dict), validated; no call it failed to parse."""
    assert not message.invalid_tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    return [(call["name"], call["args"]) for call in message.tool_calls]


# -- litellm ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def complete(server, model):
    def complete(**request):
        return litellm.completion(
            model=f"openai/{model}", api_base=server.url + "/v1", api_key="none", max_retries=0, timeout=60, **request
        )

    return complete


def test_litellm_plain_chat_equals_the_openai_client(server, complete):
    reply = complete(messages=ASK, max_tokens=8, temperature=0)
    client, model = client_and_model(server)
    reference = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == reference.choices[0].message.content != ""
    assert reply.choices[0].finish_reason == reference.choices[0].finish_reason
    assert reply.usage.completion_tokens == reference.usage.completion_tokens


@pytest.fixture(scope="module")
def litellm_required(complete):
    request = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=48)
    return request, complete(**request, temperature=0)


def test_litellm_required_and_named_tool_calls(complete, litellm_required):
    _, required = litellm_required
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(_calls(choice.message.tool_calls)) == 1
    named = complete(
        messages=ASK, tools=TOOLS, tool_choice=SEARCH_CHOICE, parallel_tool_calls=False, max_tokens=48, temperature=0
    )
    assert named.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in _calls(named.choices[0].message.tool_calls)] == ["search"]


def test_litellm_streamed_tool_calls_equal_the_whole_response(complete, litellm_required):
    request, whole = litellm_required
    chunks = list(complete(**request, temperature=0, stream=True))
    calls: dict[int, dict] = {}  # assembled from the deltas, as a client without litellm's helpers would
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    expected = _calls(whole.choices[0].message.tool_calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    built = litellm.stream_chunk_builder(chunks)  # litellm's own assembly
    assert _calls(built.choices[0].message.tool_calls) == expected


def test_litellm_sends_the_call_and_its_result_back(complete, litellm_required):
    request, whole = litellm_required
    message = whole.choices[0].message  # litellm's own Message object, as an agent loop passes it back
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees, sunny"}
    reply = complete(messages=[*ASK, message, result], tools=TOOLS, max_tokens=1, temperature=0)
    # The call and its result are in the prompt (rendered by perfx, not refused).
    assert reply.usage.prompt_tokens > whole.usage.prompt_tokens + 20


def test_litellm_json_schema_response_format(complete):
    for response_format in (PERSON_FORMAT, Person):  # a schema, and a pydantic class litellm turns into one
        reply = complete(messages=PERSON_CHAT, response_format=response_format, max_tokens=40, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        document = json.loads(reply.choices[0].message.content)
        if response_format is Person:
            Person.model_validate(document)
        else:
            jsonschema.validate(document, PERSON)


# -- langchain-openai -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(server, model):
    return ChatOpenAI(
        base_url=server.url + "/v1", api_key="none", model=model, temperature=0, max_tokens=48, max_retries=0
    )


@pytest.fixture(scope="module")
def lc_named(chat):
    return chat.bind_tools(TOOLS, tool_choice="search", parallel_tool_calls=False).invoke(ASK)


def test_langchain_bind_tools_required_and_named(chat, lc_named):
    # "any" is langchain's spelling of OpenAI's "required" (sent as "required"); a bare tool name is a named choice.
    required = chat.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False).invoke(ASK)
    for message in (required, lc_named):
        assert len(_lc_calls(message)) == 1 and message.response_metadata["finish_reason"] == "tool_calls"
        assert message.tool_calls[0]["id"].startswith("call_")
    assert lc_named.tool_calls[0]["name"] == "search"


def test_langchain_sends_the_call_and_its_result_back(chat, lc_named):
    result = ToolMessage("18 degrees, sunny", tool_call_id=lc_named.tool_calls[0]["id"])
    reply = chat.bind_tools(TOOLS).invoke([HumanMessage(ASK[0]["content"]), lc_named, result], max_tokens=1)
    assert reply.usage_metadata["input_tokens"] > lc_named.usage_metadata["input_tokens"] + 20


def test_langchain_streamed_tool_calls_equal_invoke(chat, lc_named):
    chunks = list(chat.bind_tools(TOOLS, tool_choice="search", parallel_tool_calls=False).stream(ASK))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    streamed = sum(chunks[1:], chunks[0])  # langchain merges the tool-call chunks by index
    assert _lc_calls(streamed) == _lc_calls(lc_named) and len(streamed.tool_calls) == 1
    assert streamed.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_structured_output_with_a_pydantic_model_and_a_schema(chat):
    person = chat.with_structured_output(Person, method="json_schema").invoke(PERSON_CHAT)
    assert isinstance(person, Person)
    document = chat.with_structured_output({"title": "person", **PERSON}, method="json_schema").invoke(PERSON_CHAT)
    jsonschema.validate(document, PERSON)
    # Streamed: the last value is the whole object, the same greedy one.
    streamed = list(chat.with_structured_output(Person, method="json_schema").stream(PERSON_CHAT))
    assert streamed and streamed[-1] == person
