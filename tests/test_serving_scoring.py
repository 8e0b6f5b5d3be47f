"""Scoring through a real `perfx serve` (SmolLM2): echo + logprobs in the legacy completions shape, prompt lists,
chat logprobs, and the tokenizer routes lm-evaluation-harness uses instead of a local tokenizer. The scores must
equal those computed from the same model's logits in another process with the same kernels."""

from __future__ import annotations

import httpx
import pytest
from test_serving import client_and_model, run_reference, serve

openai = pytest.importorskip("openai")

TEXTS = ["The capital of France is Paris.", "Water boils at one hundred degrees."]
# The reference: log-softmax of the teacher-forced logits, float64, in a process running the server's kernels.
REFERENCE = """
import json, sys
import numpy as np
import perfx_core
from perfx_core.logprobs import log_softmax
m = perfx_core.load(None, context_length=512)
out = []
for text in json.loads(sys.argv[1]):
    ids = m.tokenizer.encode(text, add_special=True)
    logp = log_softmax(m.logits(ids))
    out.append({"ids": ids, "logprobs": [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))],
                "best": [int(np.argmax(logp[i - 1])) for i in range(1, len(ids))],
                "next_best": int(np.argmax(logp[-1]))})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference():
    return run_reference(REFERENCE, TEXTS)


@pytest.fixture(scope="module")
def server():
    yield from serve("--max-running", "4")


def _client(server):
    return client_and_model(server)


def _post(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_max_tokens_0_scores_each_prompt_token(server, reference):
    body = {"prompt": [r["ids"] for r in reference], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    result = _post(server, "/v1/completions", body)
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert result["usage"]["completion_tokens"] == 0
    for choice, ref, text in zip(result["choices"], reference, TEXTS, strict=True):
        logprobs = choice["logprobs"]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert len(logprobs["tokens"]) == len(ref["ids"])
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(ref["logprobs"], abs=1e-5)
        for i, top in enumerate(logprobs["top_logprobs"][1:]):
            (best_logprob,) = top.values()
            chosen = logprobs["token_logprobs"][i + 1]
            assert (chosen == best_logprob) == (ref["ids"][i + 1] == ref["best"][i])
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_echo_with_one_token_scores_the_prompt_then_the_new_token(server, reference):
    """lm-evaluation-harness's loglikelihood request: max_tokens 1, the last entry is the generated token."""
    ref = reference[0]
    body = {"prompt": ref["ids"], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ref["ids"]) + 1
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(ref["logprobs"], abs=1e-5)
    generated_top = logprobs["top_logprobs"][-1]
    assert logprobs["token_logprobs"][-1] == max(generated_top.values())  # greedy took the best token
    assert choice["text"].startswith(TEXTS[0])


def test_generated_logprobs_stream_and_match_the_whole_response(server):
    client, model = _client(server)
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, logprobs=3, temperature=0)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == whole.choices[0].text
    assert all(
        len(top) == 3 and max(top.values()) == chosen
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chunks = list(
        client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=6, logprobs=3, temperature=0, stream=True
        )
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    # The second request reuses the first one's cached prompt: the same values to float rounding.
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs_with_the_openai_client(server):
    client, model = _client(server)
    messages = [{"role": "user", "content": "Say hello."}]
    result = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(result.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0, stream=True
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_prompt_lists_give_one_choice_each(server):
    result = _post(server, "/v1/completions", {"prompt": TEXTS, "max_tokens": 3, "temperature": 0})
    singles = [
        _post(server, "/v1/completions", {"prompt": t, "max_tokens": 3, "temperature": 0})["choices"][0]["text"]
        for t in TEXTS
    ]
    assert [c["text"] for c in sorted(result["choices"], key=lambda c: c["index"])] == singles
    assert result["usage"]["completion_tokens"] == 6


def test_tokenizer_routes(server, reference):
    ref = reference[0]
    tokens = _post(server, "/tokenize", {"prompt": TEXTS[0]})
    assert tokens["tokens"] == ref["ids"] and tokens["count"] == len(ref["ids"]) and tokens["max_model_len"] == 512
    assert _post(server, "/detokenize", {"tokens": ref["ids"]})["prompt"] == TEXTS[0]
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    eos = _post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert len(eos) == 1  # control tokens spelled in a prompt are parsed, as lm-eval expects
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"][-1] != eos[0] and chat["count"] > 3
    model_id = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    assert httpx.get(server.url + f"/v1/models/{model_id}").json()["id"] == model_id
    assert httpx.get(server.url + "/v1/models/gpt-4o").status_code == 404


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ["hi"] * 65}, "prompt"),
        ({"prompt": ["hi", ""]}, "prompt"),
    ],
)
def test_bad_scoring_requests_are_400(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
