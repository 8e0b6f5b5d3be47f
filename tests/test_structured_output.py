"""Structured output (perfx_core.grammar, llguidance): JSON schemas and JSON objects as a token mask, through the
Python API on the real SmolLM2 and through a real `perfx serve` with the official openai client (its
``parse()`` with a pydantic model included). Every output is checked with ``jsonschema``, also at temperature > 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from pydantic import BaseModel, Field
from test_serving import client_and_model

from perfx_core.errors import InvalidArgumentError
from perfx_core.grammar import GrammarError, json_schema_grammar, lark_grammar
from perfx_core.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")

VOCABS = Path(__file__).parent / "data" / "vocab"
MOVIE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "actors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["title", "year", "genre", "actors"],
    "additionalProperties": False,
}
# Short outputs (~20 tokens) keep the tests fast; enum, bounds and lengths still constrain every part.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
PERSON_CHAT = [{"role": "user", "content": "Invent a person."}]
CAPITAL_CHAT = [{"role": "user", "content": 'What is the capital of France? Answer in JSON with the key "capital".'}]
# Temperatures up to the server's maximum, with every filter off: the mask alone keeps the output valid.
FREE = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


# -- the Python API -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, seed", [(0, None), (2.0, 3)])  # (the server's tests take 1 and 1.5)
def test_json_schema_output_validates_at_any_temperature(smollm2, temperature, seed):
    generation = smollm2.chat(
        PERSON_CHAT, max_tokens=40, temperature=temperature, seed=seed, json_schema=PERSON, **FREE
    )
    text = generation.run()
    jsonschema.validate(json.loads(text), PERSON)
    # The grammar was complete at the closing brace: the generation ends there, not on an end-of-sequence token.
    assert generation.stats.finish_reason == "stop" and text.endswith("}")
    assert smollm2.tokenizer.decode(generation.token_ids) == text


def test_json_object_and_a_pydantic_class(smollm2):
    text = smollm2.chat(CAPITAL_CHAT, max_tokens=32, temperature=0, response_format={"type": "json_object"}).run()
    assert isinstance(json.loads(text), dict)
    person = smollm2.chat(PERSON_CHAT, max_tokens=40, temperature=1.0, seed=1, json_schema=Person).run()
    Person.model_validate_json(person)  # (its schema closed to other keys, as the openai SDK sends it)
    # Without a grammar the same greedy request is prose: the grammar is what makes it JSON.
    with pytest.raises(json.JSONDecodeError):
        json.loads(smollm2.chat(PERSON_CHAT, max_tokens=12, temperature=0).run())


def test_the_mask_allows_exactly_the_grammar(smollm2):
    """On the real 49k vocabulary, at each step of {"enum": ["yes", "no", "maybe"]}: the allowed tokens are exactly
    the text tokens whose bytes continue the output towards one of the three JSON strings, and masking keeps their
    logits and no others."""
    tok = smollm2.tokenizer
    values = [b'"yes"', b'"no"', b'"maybe"']
    pieces = [b"" if i in tok.special_tokens.values() else tok.token_to_bytes(i) for i in range(tok.vocab_size)]
    constraint = json_schema_grammar({"enum": ["yes", "no", "maybe"]}, tok).constraint()
    logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
    done, sizes = b"", []
    while not constraint.complete:
        allowed = constraint.allowed()
        expected = np.array([bool(p) and any(v.startswith(done + p) for v in values) for p in pieces])
        assert np.array_equal(allowed, expected), done
        masked = constraint.mask_logits(logits)
        assert np.array_equal(masked[allowed], logits[allowed]) and np.all(masked[~allowed] == -np.inf)
        sizes.append(int(allowed.sum()))
        token = max(np.flatnonzero(allowed), key=lambda i: (values[2].startswith(done + pieces[i]), len(pieces[i])))
        constraint.accept(int(token))
        done += pieces[token]
    assert done == b'"maybe"' and max(sizes) >= 3
    with pytest.raises(GrammarError):
        json_schema_grammar({"enum": ["yes", "no"]}, tok).constraint().accept(tok.encode("no")[0])  # unquoted


@pytest.mark.parametrize("vocab", ["ggml-vocab-llama-spm.gguf"])  # (SmolLM2 is byte-level BPE)
def test_grammars_work_on_gguf_vocabularies_without_a_tokenizer_json(vocab):
    """The engine's view of the vocabulary comes from perfx's tokenizer (SentencePiece and byte-level BPE GGUF
    files): a valid document is reachable through the mask, token by token, its tokens decode (as perfx decodes a
    completion: SentencePiece's leading space dropped at the start) to that document, and it ends the grammar."""
    tok = load_tokenizer(VOCABS / vocab)
    target = '{"title": "Été", "year": 1999, "genre": "drama", "actors": ["A\\nB"]}'
    constraint = json_schema_grammar(MOVIE, tok).constraint()
    pieces = [tok.token_to_bytes(i) for i in range(tok.vocab_size)]
    ids: list[int] = []
    done = b""
    while done != target.encode():
        allowed = np.flatnonzero(constraint.allowed())
        if not ids:  # the first token's text is as the completion's decode gives it
            pieces_here = {int(i): tok.decode([int(i)]).encode() for i in allowed}
        else:
            pieces_here = {int(i): pieces[i] for i in allowed}
        fits = [i for i, p in pieces_here.items() if p and target.encode().startswith(done + p)]
        step = max(fits, key=lambda i: len(pieces_here[i]))
        constraint.accept(step)
        ids.append(step)
        done += pieces_here[step]
    assert constraint.complete and tok.decode(ids) == target


def test_bad_schemas_and_grammars_are_typed_errors(smollm2):
    tok = smollm2.tokenizer
    for schema in ({"type": "strnig"}, {"type": "object", "unevaluatedProperties": False}, ["not", "a", "schema"]):
        with pytest.raises(GrammarError) as caught:
            json_schema_grammar(schema, tok)
        assert isinstance(caught.value, InvalidArgumentError)
    with pytest.raises(GrammarError, match="unknown name"):
        lark_grammar("start: missing_rule", tok)
    with pytest.raises(InvalidArgumentError, match="one of"):
        smollm2.generate("x", json_schema=MOVIE, response_format={"type": "json_object"})


# -- the server -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(grammar_server):
    return grammar_server


@pytest.fixture(scope="module")
def client(server):
    return client_and_model(server)


def test_sdk_parse_with_a_pydantic_model(client):
    client, model = client
    for temperature, seed in ((0, None), (1.5, 8)):
        completion = client.chat.completions.parse(
            model=model,
            messages=PERSON_CHAT,
            response_format=Person,
            max_tokens=40,
            temperature=temperature,
            seed=seed,
        )
        choice = completion.choices[0]
        assert isinstance(choice.message.parsed, Person) and choice.finish_reason == "stop"
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_schema_on_chat_and_completions(client):
    client, model = client
    chat = client.chat.completions.create(
        model=model, messages=CAPITAL_CHAT, max_tokens=32, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model=model,
        prompt="A person, as JSON:",
        max_tokens=40,
        temperature=1.0,
        seed=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_streamed_output_validates(client):
    client, model = client
    stream = client.chat.completions.create(
        model=model,
        messages=PERSON_CHAT,
        max_tokens=40,
        temperature=1.0,
        seed=11,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_constrained_and_free_requests_share_a_batch(client, server):
    """Three constrained requests at temperature 1 and one free greedy one, decoded together: each constrained
    output validates, and the free one is the text it gets alone."""
    client, model = client
    free = dict(model=model, messages=CAPITAL_CHAT, max_tokens=24, temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content
    batched_before = _batched_steps(server)
    schemas = [PERSON, {"enum": ["yes", "no"]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 4}]
    results: dict[int, str] = {}

    def constrained(i: int) -> None:
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        results[i] = (
            client.chat.completions.create(
                model=model,
                messages=PERSON_CHAT,
                max_tokens=40,
                temperature=1.0,
                seed=20 + i,
                response_format=response_format,
            )
            .choices[0]
            .message.content
        )

    def unconstrained() -> None:
        results[3] = client.chat.completions.create(**free).choices[0].message.content

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(3)] + [
        threading.Thread(target=unconstrained)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, schema in enumerate(schemas):
        jsonschema.validate(json.loads(results[i]), schema)
    assert results[3] == alone
    assert _batched_steps(server) > batched_before


def _batched_steps(server) -> float:
    """Decode steps of more than one sequence so far."""
    metrics = server.metrics()
    return metrics["perfx_decode_batch_size_count"] - metrics['perfx_decode_batch_size_bucket{le="1.0"}']


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "unevaluatedProperties": False}},
        },
        {"type": "json_schema"},
        {"type": "xml"},
        "json",
    ],
)
def test_bad_response_formats_are_400_naming_it(client, response_format):
    client, model = client
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=CAPITAL_CHAT, max_tokens=4, extra_body={"response_format": response_format}
        )
    assert caught.value.body["param"] == "response_format"
