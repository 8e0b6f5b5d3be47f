"""`n > 1` on chat and completions against a real `perfx serve`: n choices per prompt, each with its own index,
whole and streamed; the choices after the first copy the prompt's KV cache from the first instead of computing
it (the metrics count those tokens as cached); seeded requests repeat with choices that differ. And a server
started without --served-model-name serves whatever model name a client sends."""

from __future__ import annotations

import httpx
import pytest
from test_serving import serve

openai = pytest.importorskip("openai")

# Longer than the server's 64-token prefill chunk. Each test gets one whose start no other prompt shares, so
# only the copy between the choices (not the prefix cache of free slots) can give the cached tokens.
STORY = (
    "The fog lifted at dawn and the fishing boats went out past the breakwater one by one; the gulls followed the "
    "last of them, a blue trawler with a patched sail, until it rounded the point. By noon the wind had turned to "
    "the west and the harbor master hung out the storm flags, so the first boats came back early with half their "
    "nets empty. In the evening the"
)
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    yield from serve("--max-running", "4")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _cached_tokens(server) -> float:
    return server.metrics()["perfx_prompt_tokens_cached_total"]


@pytest.mark.parametrize(
    "opening, max_tokens",
    # One token: the first choice ends in the step its prefill does, before the others have copied its cache.
    [("Harbor log, day nine.", 1), ("From the diary of a lighthouse keeper:", 6)],
)
def test_greedy_choices_share_the_prefill_and_equal_one_choice(server, client, opening, max_tokens):
    prompt = f"{opening} {STORY}"
    prompt_tokens = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert prompt_tokens > 64
    before = _cached_tokens(server)
    three = client.completions.create(model="m", prompt=prompt, n=3, max_tokens=max_tokens, temperature=0)
    # The second and third choice copied all but the prompt's last token from the first one's slot.
    assert _cached_tokens(server) - before >= 2 * (prompt_tokens - 1)
    assert [c.index for c in three.choices] == [0, 1, 2]
    one = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3  # the copied cache is the computed one
    assert three.usage.prompt_tokens == prompt_tokens  # counted once, as OpenAI does
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_choices_differ_and_repeat(client):
    def sample():
        result = client.chat.completions.create(model="m", messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=11)
        return [c.message.content for c in result.choices]

    first = sample()
    assert len(set(first)) > 1  # each choice draws from a stream of its own
    assert sample() == first


def test_streamed_choices_carry_their_index_and_equal_the_whole_response(client):
    whole = client.chat.completions.create(model="m", messages=CHAT, n=2, max_tokens=8, temperature=0.8, seed=5)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=CHAT,
            n=2,
            max_tokens=8,
            temperature=0.8,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_prompt_lists_take_n_choices_each_in_order(client):
    prompts = ["The sky is", "My favourite food is"]
    result = client.completions.create(model="m", prompt=prompts, n=2, max_tokens=4, temperature=0)
    texts = [c.text for c in result.choices]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # choice i * n + j belongs to prompt i
    singles = [client.completions.create(model="m", prompt=p, max_tokens=4, temperature=0) for p in prompts]
    assert [texts[0], texts[2]] == [s.choices[0].text for s in singles]
    assert result.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_echo_with_n_returns_the_prompt_in_every_choice(client):
    result = client.completions.create(model="m", prompt="Roses are", n=2, max_tokens=3, temperature=0, echo=True)
    assert all(c.text.startswith("Roses are") for c in result.choices)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "n": 5},  # more than the 4 slots
        {"prompt": ["hi"] * 17, "n": 4},  # 68 choices: more than 64 in one request
        {"prompt": "hi", "n": "two"},
    ],
)
def test_n_beyond_the_bounds_is_400(server, body):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text


def test_any_model_name_is_served_and_the_file_name_reported(client):
    (listed,) = client.models.list().data
    result = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2, temperature=0)
    assert result.model == listed.id == "SmolLM2-135M-Instruct.Q4_1"
    embedded = client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert embedded.model == listed.id
