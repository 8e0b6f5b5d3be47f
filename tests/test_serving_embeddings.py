"""Embeddings: ``Model.embed`` in the Python API (the unit-length mean of the final-normed hidden states, the
rows the logits come from) and `POST /v1/embeddings` of a real `perfx serve` through the openai client, whose
vectors must equal the Python API's, computed in another process with the server's kernels."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from logits_tolerance import assert_same_logits
from test_serving import SERVER_ENV, client_and_model, serve

from perfx_core.errors import InvalidArgumentError
from perfx_core.pooling import embedding_of

openai = pytest.importorskip("openai")

TEXTS = [
    "The capital of France is Paris.",
    "Paris is the capital city of France.",
    "Bananas are yellow when they are ripe.",
    # Longer than the server's 64-token prefill chunk: pooled over two chunks.
    " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 7),
]
# The reference: the Python API with the server's kernels and prefill chunk (64), in a process of its own.
REFERENCE = """
import json, sys
import perfx_core
m = perfx_core.load(None, context_length=512, prefill_chunk=64)
texts = json.loads(sys.argv[1])
print(json.dumps({"ids": [m.tokenizer.encode(t, add_special=True) for t in texts],
                  "vectors": m.embed(texts).tolist()}))
"""


@pytest.fixture(scope="module")
def reference_process():
    """Started before the server, so the two load side by side."""
    process = subprocess.Popen(
        [sys.executable, "-c", REFERENCE, json.dumps(TEXTS)], env=SERVER_ENV, stdout=subprocess.PIPE, text=True
    )
    yield process
    process.kill()


@pytest.fixture(scope="module")
def reference(reference_process):
    out = json.loads(reference_process.communicate(timeout=120)[0])
    return out["ids"], np.array(out["vectors"], dtype=np.float32)


@pytest.fixture(scope="module")
def server(reference_process):
    yield from serve("--max-running", "2")


# -- the Python API -----------------------------------------------------------------------------------------


def test_hidden_states_are_the_rows_the_logits_come_from(smollm2):
    ids = smollm2.tokenizer.encode("Hidden states feed the output projection.", add_special=True)
    hidden = smollm2.engine.prefill_hidden(ids, slot=0)
    assert hidden.shape == (len(ids), smollm2.config.dim) and hidden.dtype == np.float32
    projected = hidden @ smollm2.engine.output.float32().T  # the numpy backend's output weight
    assert_same_logits(smollm2.logits(ids), projected)


def test_embed_pools_every_token_to_unit_length(smollm2):
    single = smollm2.embed(TEXTS[0])
    batch = smollm2.embed(TEXTS[:3])
    assert single.shape == (smollm2.config.dim,) and batch.shape == (3, smollm2.config.dim)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1, atol=1e-5)
    assert np.array_equal(batch[0], single)
    ids = smollm2.tokenizer.encode(TEXTS[1], add_special=True)
    from_ids = smollm2.embed(ids)
    assert np.array_equal(from_ids, batch[1])  # token ids embed like their text
    hidden = smollm2.engine.prefill_hidden(ids, slot=0)
    expected = hidden.astype(np.float64).mean(axis=0)
    assert np.abs(from_ids - expected / np.linalg.norm(expected)).max() < 1e-6
    assert np.array_equal(embedding_of(hidden), batch[1])
    similar, unrelated = batch[0] @ batch[1], batch[0] @ batch[2]
    assert similar > unrelated  # the paraphrase is nearer than the fruit


def test_embed_leaves_a_running_generation_alone(smollm2):
    prompt = "Once upon a time"
    expected = smollm2.generate(prompt, max_tokens=8, temperature=0).run()
    generation = smollm2.generate(prompt, max_tokens=8, temperature=0)
    events = iter(generation)
    first = [next(events).text for _ in range(3)]
    smollm2.embed(TEXTS[:2])  # between two of its steps, in slots of its own
    assert "".join(first + [e.text for e in events]) == expected


@pytest.mark.parametrize("bad", ["", [], [[]], [1.5], ["ok", ""]])
def test_embed_refuses_empty_or_wrong_inputs(smollm2, bad):
    with pytest.raises(InvalidArgumentError):
        smollm2.embed(bad)


# -- the server ---------------------------------------------------------------------------------------------


def test_openai_client_embeddings_equal_the_python_api(server, reference):
    ids, vectors = reference
    client, model = client_and_model(server)
    result = client.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert np.abs(got - vectors).max() < 1e-6
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(i) for i in ids)
    assert result.model == model
    as_float = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert np.abs(np.array(as_float.data[0].embedding, dtype=np.float32) - vectors[0]).max() < 1e-6
    dim = vectors.shape[1]
    same_size = client.embeddings.create(model=model, input=TEXTS[2], dimensions=dim)
    assert len(same_size.data[0].embedding) == dim


def test_token_id_inputs_and_base64_on_the_wire(server, reference):
    ids, vectors = reference
    one = httpx.post(server.url + "/v1/embeddings", json={"input": ids[1], "encoding_format": "base64"}, timeout=60)
    assert one.status_code == 200, one.text
    raw = base64.b64decode(one.json()["data"][0]["embedding"])
    assert np.abs(np.frombuffer(raw, dtype="<f4") - vectors[1]).max() < 1e-6
    many = httpx.post(server.url + "/v1/embeddings", json={"input": [ids[2], ids[0]]}, timeout=60).json()
    assert np.abs(np.array([d["embedding"] for d in many["data"]]) - vectors[[2, 0]]).max() < 1e-6
    assert many["usage"]["prompt_tokens"] == len(ids[2]) + len(ids[0])


def test_more_inputs_than_slots_keep_their_order_next_to_a_stream(server, reference):
    """Five inputs through two slots while a chat completion streams: the inputs enter a few at a time, the
    stream finishes, and each vector is its input's."""
    _, vectors = reference
    client, model = client_and_model(server)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12, temperature=0, stream=True
    )
    order = [2, 0, 1, 2, 0]
    result = client.embeddings.create(model=model, input=[TEXTS[i] for i in order])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert np.abs(got - vectors[order]).max() < 1e-6


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": TEXTS[0], "dimensions": 64}, "dimensions"),
        ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [49152]}, "input"),  # past the vocabulary
        ({"input": "word " * 600}, "input"),  # past the 512-token context
        ({"input": ["a"] * 2049}, "input"),
        ({}, "input"),
        ({"input": "x", "model": 3}, "model"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_parameter(server, body, param):
    response = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
