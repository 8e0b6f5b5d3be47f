"""`POST /v1/responses` (OpenAI's Responses API, mapped onto chat) and `--served-model-name`, through the openai
client against a real `perfx serve`: the greedy output must equal the Python API's chat with the same messages,
computed in another process with the server's kernels; streaming gives the Responses event sequence."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from test_serving import SERVER_ENV, serve

openai = pytest.importorskip("openai")

ALIASES = ("perfx-small", "gpt-4o-mini")
INSTRUCTIONS = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
MAX_TOKENS = 8
REFERENCE = f"""
import json, perfx_core
m = perfx_core.load(None, context_length=512)
messages = {MESSAGES!r}
print(json.dumps({{"text": m.chat(messages, max_tokens={MAX_TOKENS}, temperature=0).run(),
                  "prompt_tokens": len(m.chat_prompt_ids(messages))}}))
"""


@pytest.fixture(scope="module")
def reference_process():
    """Started before the server, so the two load side by side."""
    process = subprocess.Popen([sys.executable, "-c", REFERENCE], env=SERVER_ENV, stdout=subprocess.PIPE, text=True)
    yield process
    process.kill()


@pytest.fixture(scope="module")
def reference(reference_process):
    return json.loads(reference_process.communicate(timeout=120)[0])


@pytest.fixture(scope="module")
def server(reference_process):
    yield from serve("--max-running", "2", "--served-model-name", *ALIASES)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_responses_create_equals_the_python_api_chat(client, reference):
    response = client.responses.create(
        model=ALIASES[1], instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert response.output_text == reference["text"]
    assert response.model == ALIASES[1] and response.id.startswith("resp_") and response.object == "response"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert (
        usage.input_tokens == reference["prompt_tokens"]
        and usage.total_tokens == usage.input_tokens + usage.output_tokens
    )
    # max_output_tokens ran out (incomplete), or the model ended its answer first (completed)
    if usage.output_tokens == MAX_TOKENS:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_message_items_with_text_parts_give_the_same_answer(client, reference):
    response = client.responses.create(
        model=ALIASES[0],
        input=[
            {"role": "developer", "content": INSTRUCTIONS},  # developer = system, as in chat
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        top_p=1,
    )
    assert response.output_text == reference["text"]


def test_streaming_gives_the_responses_events_in_order(client, reference):
    events = list(
        client.responses.create(
            model=ALIASES[0],
            instructions=INSTRUCTIONS,
            input=QUESTION,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final.type,
    ]
    assert final.type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == reference["text"] == final.response.output_text
    assert events[-4].text == text and events[0].response.status == "in_progress"
    assert final.response.usage.input_tokens == reference["prompt_tokens"]
    assert len({d.item_id for d in deltas}) == 1 and deltas[0].item_id == final.response.output[0].id


def test_text_format_gives_structured_output_the_sdk_parses(client):
    """`responses.parse` sends text.format as a strict JSON schema, which becomes the chat response_format."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        country: str

    response = client.responses.parse(
        model=ALIASES[0], input="Name a city in France.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert response.status == "completed" and isinstance(response.output_parsed, City)
    assert response.text.format.type == "json_schema" and response.text.format.name == "City"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": ""}, "input"),
        ({}, "input"),
    ],
)
def test_what_does_not_map_onto_chat_is_400_naming_the_parameter(server, body, param):
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_served_model_names_are_listed_and_the_only_names_accepted(server, client):
    assert [m.id for m in client.models.list().data] == list(ALIASES)
    assert httpx.get(server.url + f"/v1/models/{ALIASES[1]}").json()["id"] == ALIASES[1]
    assert httpx.get(server.url + "/v1/models/SmolLM2-135M-Instruct.Q4_1").status_code == 404  # the file's name
    chat = client.chat.completions.create(
        model=ALIASES[0], messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert chat.model == ALIASES[0]
    unnamed = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).json()
    assert unnamed["model"] == ALIASES[0]  # no name given: the first one is reported
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.body["code"] == "model_not_found" and refused.value.body["param"] == "model"
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ]:
        response = httpx.post(server.url + path, json={**body, "model": "gpt-4"}, timeout=30)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", path
