"""Prefix caching: a prompt that starts with what a free slot's cache holds is prefilled only past that point,
and gives exactly the completion a fresh model gives (Python API and a real server)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from golden_text import GOLDEN_TEXT
from test_serving import SERVER_ENV, Server

import perfx_core
from perfx_core.default_model import bundled_model_path
from perfx_core.prefix_cache import SlotPrefixes, shared_prefix

TURN_1 = [{"role": "user", "content": "Name a large city in France."}]


def test_shared_prefix_and_slot_choice():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2, 3]) == 2 and shared_prefix([7], [1]) == 0
    prefixes = SlotPrefixes(3)
    for slot, tokens in ((0, [5, 6, 7]), (1, [1, 2, 3, 4]), (2, [1, 2])):
        prefixes.take(slot)
        prefixes.remember(slot, tokens)
    assert prefixes.choose([0, 1, 2], [1, 2, 3, 9]) == (1, 3)
    assert prefixes.choose([0, 1, 2], [1, 2, 3, 4]) == (1, 3)  # the last token is always computed
    assert prefixes.choose([0, 2], [9, 9]) == (0, 0)  # no agreement: the least recently used slot
    prefixes.forget_all()
    assert prefixes.choose([0, 1, 2], [1, 2, 3]) == (0, 0)


def test_a_conversations_next_turn_reuses_its_cache(smollm2_path):
    model = perfx_core.load(smollm2_path, context_length=512, n_slots=2)
    fresh = perfx_core.load(smollm2_path, context_length=512)
    try:
        reply = model.chat(TURN_1, max_tokens=16, temperature=0).run()
        turn_2 = [*TURN_1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And in Italy?"}]
        second = model.chat(turn_2, max_tokens=16, temperature=0)
        text = second.run()
        assert second.stats.cached_prompt_tokens >= len(model.chat_prompt_ids(TURN_1))
        expected = fresh.chat(turn_2, max_tokens=16, temperature=0)
        assert text == expected.run() and expected.stats.cached_prompt_tokens == 0
        # The same prompt again: all but its last token come from the cache.
        again = model.chat(turn_2, max_tokens=16, temperature=0)
        assert again.run() == text and again.stats.cached_prompt_tokens == again.stats.prompt_tokens - 1
    finally:
        model.close()
        fresh.close()


REFERENCE = """
import json, sys
import perfx_core
m = perfx_core.load(None, context_length=1024)
print(json.dumps([m.generate(p, max_tokens=12, temperature=0).run() for p in json.loads(sys.argv[1])]))
"""


def test_the_server_reuses_a_shared_prefix_and_answers_the_same():
    prefix = (GOLDEN_TEXT + " ") * 2
    prompts = [prefix + " In short,", prefix + " The captain", prefix + " The captain"]
    run = subprocess.run(
        [sys.executable, "-c", REFERENCE, json.dumps(prompts)], env=SERVER_ENV, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    server = Server("--max-running", "2").wait_ready()
    try:
        texts, cached = [], []
        for prompt in prompts:
            before = server.metrics().get("perfx_prompt_tokens_cached_total", 0)
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            cached.append(server.metrics()["perfx_prompt_tokens_cached_total"] - before)
    finally:
        server.stop()
    assert texts == expected
    tokenizer = perfx_core.load_tokenizer(bundled_model_path())
    prefix_tokens = len(tokenizer.encode(prefix))
    assert prefix_tokens > 300
    assert cached[0] == 0 and cached[1] >= prefix_tokens - 2
    assert cached[2] == len(tokenizer.encode(prompts[2], add_special=True)) - 1  # all but the last token


def test_scored_prompts_are_computed_whole():
    """A prompt whose every row is scored (echo + logprobs) cannot skip rows: it is prefilled whole."""
    server = Server("--max-running", "1").wait_ready()
    try:
        body = {"prompt": GOLDEN_TEXT[:300], "max_tokens": 0, "echo": True, "logprobs": 1}
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert server.metrics().get("perfx_prompt_tokens_cached_total", 0) == 0
        assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    finally:
        server.stop()
