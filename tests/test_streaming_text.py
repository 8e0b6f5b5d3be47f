"""Streaming detokenization: deltas add up to the decoded text, split characters and stop strings held back."""

from __future__ import annotations

import random
import time

import pytest
from golden_text import GOLDEN_TEXT

from perfx_core import InvalidArgumentError
from perfx_core.generation import StreamingText
from perfx_core.stop_strings import StopMatcher
from perfx_core.tokenizer import load_tokenizer

TRICKY = GOLDEN_TEXT + " 🦙🚀👍🏽 東京は日本の首都です。 Привет, мир! " * 3


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def stream(tokenizer, ids, stop=()):
    s = StreamingText(tokenizer, stop)
    deltas = [s.push(i) for i in ids]
    if not s.stopped:
        deltas.append(s.flush())
    return deltas, s


def test_deltas_add_up_to_decode_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TRICKY)
    assert len(ids) > 2 * 32  # long enough to pass several checkpoints
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TRICKY
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_cut_and_its_prefix_held_back(tokenizer):
    ids = tokenizer.encode(TRICKY)
    deltas, s = stream(tokenizer, ids, stop=["cinnamon rolls"])
    assert s.stopped
    assert "".join(deltas) == TRICKY[: TRICKY.index("cinnamon rolls")]
    assert not any("cinnamon" in d for d in deltas)


def test_text_that_only_starts_like_a_stop_string_is_released(tokenizer):
    ids = tokenizer.encode("the harbour at seven")
    deltas, s = stream(tokenizer, ids, stop=["seven seas"])
    assert not s.stopped and "".join(deltas) == "the harbour at seven"
    assert deltas[-1].endswith("seven")  # held back until the end proved it was not the stop string


def _brute_force(text, stops):
    """(start of the earliest-ending stop string, preferring the longest there; the longest tail of the text
    that is a proper prefix of a stop string)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            return (end - max(map(len, found)), end), 0
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return None, hold


def test_stop_matcher_agrees_with_brute_force_on_random_texts():
    rng = random.Random(7)
    for _ in range(400):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        matcher = StopMatcher(stops)
        for end in range(len(text) + 1):  # fed as it grows, as a stream does
            got = matcher.feed(text[:end], 0)
            assert got == _brute_force(text[:end], stops), (stops, text[:end])
            if got[0] is not None:
                break


def test_long_stop_strings_cost_linear_time(tokenizer):
    """Four stop strings of 4,096 characters that the text keeps almost matching: each token must cost about
    the same as without stops (quadratic checks took tens of ms per token)."""
    stops = ["ab" * 2048, "ba" * 2048, "a" * 4095 + "c", "b" * 4096]
    ids = tokenizer.encode("ab" * 1500)
    started = time.perf_counter()
    deltas, s = stream(tokenizer, ids, stop=stops)
    assert time.perf_counter() - started < 5  # ~1,500 tokens; about 0.1 s here
    assert not s.stopped and "".join(deltas) == "ab" * 1500


def test_stop_strings_are_bounded_in_total_length(tokenizer):
    with pytest.raises(InvalidArgumentError, match="at most 16384"):
        StreamingText(tokenizer, ["x" * 10000, "y" * 7000])
