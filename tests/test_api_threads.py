"""One Model used from several threads: each generation keeps its own KV slot, or the caller is told the model
is busy; text is never corrupted."""

from __future__ import annotations

import threading

import pytest

import perfx_core
from perfx_core import ModelBusyError

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Water boils at"]


def _greedy(model, prompt):
    return model.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).run()


def test_generations_from_several_threads_match_one_at_a_time(smollm2):
    expected = [_greedy(smollm2, p) for p in PROMPTS]
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def work(i):
        try:
            start.wait()
            results[i] = _greedy(smollm2, PROMPTS[i])
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    for _ in range(2):
        results.clear()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [results[i] for i in range(len(PROMPTS))] == expected


def test_a_thread_gets_model_busy_while_another_holds_the_only_slot(smollm2_path):
    model = perfx_core.load(smollm2_path, context_length=256)  # one slot
    try:
        held = model.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
        next(held)  # started: its KV slot is in use
        caught: list[BaseException] = []

        def other():
            try:
                model.generate("Hello", max_tokens=4, temperature=0).run()
            except BaseException as exc:
                caught.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join(60)
        assert len(caught) == 1 and isinstance(caught[0], ModelBusyError), caught
        assert "n_slots" in str(caught[0])
        # The held generation was not disturbed: it finishes with the text it would have had alone.
        rest = "".join(e.text for e in held)
        held_text = held.text
        assert rest and held.stats.finish_reason == "length"
        assert held_text == model.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True).run()

        # Once it has ended, the other thread may use the model.
        t = threading.Thread(target=other)
        caught.clear()
        t.start()
        t.join(60)
        assert not caught
    finally:
        model.close()


def test_a_new_generation_in_the_same_thread_replaces_the_previous(smollm2_path):
    model = perfx_core.load(smollm2_path, context_length=256)  # one slot
    try:
        first = model.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
        next(first)
        second = model.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True)
        assert first.stats.finish_reason == "cancelled"
        with pytest.raises(StopIteration):
            next(first)
        assert second.run() and second.stats.finish_reason == "length"
        # logits() from the same thread also takes the slot back from an unfinished generation.
        third = model.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True)
        next(third)
        assert model.logits(model.tokenizer.encode("Hello")).shape[0] == 1
        assert third.stats.finish_reason == "cancelled"
    finally:
        model.close()


def test_an_abandoned_generation_frees_its_slot(smollm2_path):
    model = perfx_core.load(smollm2_path, context_length=256)
    try:
        done = threading.Event()

        def abandon():
            generation = model.generate("Hello", max_tokens=4, temperature=0)
            next(generation)
            del generation  # dropped without close(): collected when the thread's frame goes
            done.set()

        t = threading.Thread(target=abandon)
        t.start()
        t.join(60)
        assert done.is_set()
        assert model.generate("Hello", max_tokens=2, temperature=0, ignore_eos=True).run()
    finally:
        model.close()
