"""Streaming detokenization: deltas add up to the decoded text, split characters and stop strings held back."""

from __future__ import annotations

import pytest
from golden_text import GOLDEN_TEXT

from perfx_core.generation import StreamingText
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
