"""The continuous-batching scheduler on a recording fake engine: chunked prefill interleaved with batched
decode, slots freed on cancel, the bounded queue, and where text goes out with and without overlapped output.
(tests/test_serving.py covers the real model over HTTP; scheduler_check.py the real model in process.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scheduler_check import Collector, check_overlapped_output, run_until_done

from perfx_core.sampling import Sampler, SamplingParams, engine_draw
from perfx_core.serving.scheduler import (
    Failed,
    Finished,
    GenerationRequest,
    QueueFullError,
    Scheduler,
    TextDelta,
)

VOCAB, EOS, NEXT = 8, 0, 5  # the fake model always predicts token NEXT


class FakeEngine:
    def __init__(self, n_slots: int, mixed_room: int = 16):
        self.n_slots, self.max_seq_len, self.mixed_room = n_slots, 128, mixed_room
        self.calls: list[tuple] = []

    def _logits(self, n: int) -> np.ndarray:
        logits = np.zeros((n, VOCAB), dtype=np.float32)
        logits[:, NEXT] = 1
        return logits

    def prefill(self, tokens, slot, start, all_logits=False):
        self.calls.append(("prefill", slot, start, len(tokens)))
        return self._logits(len(tokens)) if all_logits else self._logits(1)[0]

    def mixed_prompt_room(self, decode_rows: int) -> int:
        return self.mixed_room

    def queue_decode(self, *args, **kwargs):
        rows = self.decode(*args, **kwargs)
        return SimpleNamespace(result=lambda: rows)

    def decode(self, tokens, slots, positions, argmax=False, sampling=None, prompt=None):
        """LlamaModel.decode's contract: logits, or the picked ids (argmax, or sampling rows' draws); with a
        prompt chunk one more row, last."""
        if prompt is None:
            self.calls.append(("decode", tuple(slots), tuple(positions)))
        else:
            self.calls.append(("mixed", tuple(slots), tuple(positions), prompt[1], prompt[2], len(prompt[0])))
        rows = len(tokens) + (prompt is not None)
        logits = self._logits(rows)
        if sampling is not None:
            return np.array([engine_draw(logits[i], sampling[i]) for i in range(rows)], dtype=np.int32)
        return np.argmax(logits, axis=1).astype(np.int32) if argmax else logits


class FakeTokenizer:
    eos_ids = frozenset({EOS})

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _request(prompt_len: int, max_tokens: int, collector: Collector) -> GenerationRequest:
    return GenerationRequest([1] * prompt_len, max_tokens, SamplingParams(temperature=0), collector)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(mixed, overlap):
    engine = FakeEngine(n_slots=2)
    scheduler = Scheduler(
        engine, FakeTokenizer(), max_queue=4, prefill_chunk=4, mixed_steps=mixed, overlap_output=overlap
    )
    short, long = Collector(), Collector()
    scheduler.submit(_request(3, 12, short))
    scheduler.submit(_request(10, 3, long))
    run_until_done(scheduler, short, long)
    if mixed:  # each chunk of the long prompt rides in the short one's decode step
        assert engine.calls[:6] == [
            ("prefill", 0, 0, 3),  # nothing decodes yet: a prefill alone
            ("decode", (0,), (3,)),
            ("mixed", (0,), (4,), 1, 0, 4),
            ("mixed", (0,), (5,), 1, 4, 4),
            ("mixed", (0,), (6,), 1, 8, 2),  # its last row is the long request's first token
            ("decode", (0, 1), (7, 10)),
        ]
    else:
        assert engine.calls[:7] == [
            ("prefill", 0, 0, 3),
            ("decode", (0,), (3,)),
            ("prefill", 1, 0, 4),  # the long prompt, one chunk per iteration ...
            ("decode", (0,), (4,)),  # ... while the short one keeps generating
            ("prefill", 1, 4, 4),
            ("decode", (0,), (5,)),
            ("prefill", 1, 8, 2),
        ]
        assert engine.calls[7] == ("decode", (0, 1), (6, 10))  # then both decode in one batch
    assert scheduler.max_batch_size == 2
    assert short.events[-1] == Finished("length", 3, 12) and long.events[-1] == Finished("length", 10, 3)
    assert "".join(e.text for e in short.events[:-1]) == "f" * 12


def test_mixed_chunk_caps_the_prompt_tokens_of_a_mixed_step():
    """With mixed_chunk below prefill_chunk a mixed step takes mixed_chunk prompt tokens (the rows every decoding
    sequence waits for), while a prefill on its own still takes prefill_chunk; a prefill_chunk below mixed_chunk
    caps a mixed step too. Room for that many tokens is enough: it need not fit the larger of the two."""

    def prompt_steps(room: int, prefill_chunk: int, mixed_chunk: int) -> list[tuple]:
        """A 3-token prompt, then a 10-token one joining its decode: the prefill and mixed calls."""
        engine = FakeEngine(n_slots=2, mixed_room=room)
        scheduler = Scheduler(
            engine, FakeTokenizer(), max_queue=4, prefill_chunk=prefill_chunk, mixed_steps=True, mixed_chunk=mixed_chunk
        )
        short, long = Collector(), Collector()
        scheduler.submit(_request(3, 12, short))
        scheduler.submit(_request(10, 3, long))
        run_until_done(scheduler, short, long)
        assert long.events[-1] == Finished("length", 10, 3)
        return [c for c in engine.calls if c[0] == "mixed" or c[0] == "prefill"]

    calls = prompt_steps(room=4, prefill_chunk=8, mixed_chunk=3)
    assert calls[0] == ("prefill", 0, 0, 3)
    assert [c[4:] for c in calls[1:]] == [(0, 3), (3, 3), (6, 3), (9, 1)]  # (start, tokens) per mixed step
    calls = prompt_steps(room=3, prefill_chunk=2, mixed_chunk=16)
    assert calls[0] == ("prefill", 0, 0, 2) and calls[1] == ("prefill", 0, 2, 1)  # the short prompt, alone
    assert [c[4:] for c in calls[2:]] == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]


def test_mixed_steps_keep_seeded_draws_and_never_starve_a_prompt():
    """A seeded request draws the same tokens whether its prompt chunks ride in mixed steps or not (a chunk
    whose row is discarded must not advance its sampler); with room for fewer than a mixed chunk's tokens
    next to the decode rows, the prompt is prefilled on its own instead of a few tokens per step."""

    def run(mixed: bool, room: int = 16) -> tuple[str, list]:
        engine = FakeEngine(n_slots=2, mixed_room=room)
        engine._logits = lambda n: np.tile(np.linspace(0, 1, VOCAB, dtype=np.float32), (n, 1))  # a real draw
        scheduler = Scheduler(engine, FakeTokenizer(), max_queue=4, prefill_chunk=4, mixed_steps=mixed)
        first, second = Collector(), Collector()
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
        scheduler.submit(GenerationRequest([1] * 3, 12, SamplingParams(temperature=0), first, ignore_eos=True))
        scheduler.submit(GenerationRequest([1] * 10, 6, sampling, second, ignore_eos=True))
        run_until_done(scheduler, first, second)
        return "".join(e.text for e in second.events[:-1]), engine.calls

    plain, _ = run(False)
    mixed, calls = run(True)
    assert mixed == plain and len(plain) == 6
    assert [c[0] for c in calls].count("mixed") == 3
    _, calls = run(True, room=2)  # the 10-token prompt goes in 4-token prefills until its rest fits
    prompt_calls = [c for c in calls if c[0] == "prefill" and c[1] == 1 or c[0] == "mixed"]
    assert [c[0] for c in prompt_calls] == ["prefill", "prefill", "mixed"] and prompt_calls[-1][-2:] == (8, 2)


def test_cancelled_request_frees_its_slot_for_the_next():
    engine = FakeEngine(n_slots=1)
    scheduler = Scheduler(engine, FakeTokenizer(), max_queue=4, prefill_chunk=8)
    first, second = Collector(), Collector()
    first_request = _request(2, 100, first)

    def cancel_after_two_tokens(event) -> None:
        first(event)
        if len(first.events) == 2:
            first_request.cancel()

    first_request.emit = cancel_after_two_tokens
    scheduler.submit(first_request)
    scheduler.submit(_request(2, 3, second))
    run_until_done(scheduler, second)
    assert len(first.events) <= 3 and not first.done.is_set()  # no Finished: it was dropped
    assert second.events[-1] == Finished("length", 2, 3)
    assert scheduler.running == 0 and scheduler.slots_used == 0


def test_queue_is_bounded():
    scheduler = Scheduler(FakeEngine(n_slots=1), FakeTokenizer(), max_queue=1, prefill_chunk=8)
    scheduler.submit(_request(2, 4, Collector()))  # would take the free slot
    scheduler.submit(_request(2, 4, Collector()))  # waits
    with pytest.raises(QueueFullError):
        scheduler.submit(_request(2, 4, Collector()))


def test_fast_sampler_draws_the_tempered_softmax_and_repeats_with_a_seed():
    logits = (np.random.default_rng(0).standard_normal(20) * 2).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    sampler = Sampler(params)
    draws = [sampler(logits) for _ in range(20000)]
    expected = np.exp(logits / 0.7 - (logits / 0.7).max())
    expected /= expected.sum()
    assert np.abs(np.bincount(draws, minlength=20) / len(draws) - expected).max() < 0.015
    again = Sampler(params)
    assert [again(logits) for _ in range(50)] == draws[:50]


@pytest.mark.parametrize("mixed", [False, True])
def test_overlapped_output_matches_generation_on_the_real_model(smollm2, mixed):
    """With overlap_output a stop string is found one step late (scheduler_check.py): the completions of four
    requests decoded together stay Generation's, with the overlap on and off."""
    check_overlapped_output(smollm2, mixed)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stop, tokens", [("f", 1), ("ff", 2), ("fff", 3)])
def test_a_stop_string_ends_the_text_and_the_count_at_its_token(overlap, stop, tokens):
    """The fake model writes "f" forever; a stop string of n f's ends the completion at its n-th token with no
    text. With overlapped output the stop can be found one step late: then one extra row is computed and its
    token dropped."""
    engine = FakeEngine(n_slots=2)
    scheduler = Scheduler(engine, FakeTokenizer(), max_queue=4, prefill_chunk=4, overlap_output=overlap)
    stopped, other = Collector(), Collector()
    scheduler.submit(GenerationRequest([1] * 3, 20, SamplingParams(temperature=0), stopped, stop=(stop,)))
    scheduler.submit(_request(3, 12, other))  # keeps steps running after the stop
    run_until_done(scheduler, stopped, other)
    assert stopped.events == [Finished("stop", 3, tokens)]
    assert other.events[-1] == Finished("length", 3, 12)
    rows = [call for call in engine.calls if call[0] == "decode" and 0 in call[1]]  # slot 0: the stopped one
    # Its first token came from the prefill; at most one extra row with overlap (none when a prefill of the other
    # request came between: the text is sent before a prefill on its own).
    assert tokens - 1 <= len(rows) <= tokens - 1 + overlap


@pytest.mark.parametrize("overlap", [False, True])
def test_a_steps_text_goes_out_inside_one_hold_of_the_events(overlap):
    """Every text event and ending is emitted inside Scheduler(hold_events=...), entered once per handling of a
    step's text (both sequences' tokens of a step in the same one), so the server's event loop is woken once
    it is all out (app._EventPost)."""
    holds = []  # one flag per hold entered: still open?

    class Hold:
        def __enter__(self):
            holds.append(True)

        def __exit__(self, *exc):
            holds[-1] = False

    class Recording(Collector):
        def __init__(self):
            super().__init__()
            self.holds = []  # per event: the hold it was emitted in (None: outside any)

        def __call__(self, event):
            self.holds.append(len(holds) if holds and holds[-1] else None)
            super().__call__(event)

    scheduler = Scheduler(
        FakeEngine(n_slots=2), FakeTokenizer(), max_queue=4, prefill_chunk=4, overlap_output=overlap, hold_events=Hold
    )
    collectors = [Recording(), Recording()]
    for collector in collectors:
        scheduler.submit(_request(3, 5, collector))
    run_until_done(scheduler, *collectors)
    assert [c.events[-1] for c in collectors] == [Finished("length", 3, 5)] * 2
    first, second = (c.holds for c in collectors)
    assert len(first) == len(second) == 6 and None not in first + second  # 5 tokens' text and the ending
    assert len(set(first) & set(second)) >= 2  # while decoding together: a step's two texts in one hold


def test_without_overlap_each_token_goes_out_before_the_next_step():
    """Without overlapped output (the CPU default) the first token's text is sent right after its prefill, and
    each later one right after its step, before anything else is queued."""
    engine = FakeEngine(n_slots=1)
    scheduler = Scheduler(engine, FakeTokenizer(), max_queue=4, prefill_chunk=8)
    seen: list[int] = []
    collector = Collector()

    def emit(event) -> None:
        seen.append(len(engine.calls))  # engine calls made when the event went out
        collector(event)

    scheduler.submit(GenerationRequest([1] * 3, 3, SamplingParams(temperature=0), emit))
    run_until_done(scheduler, collector)
    assert [type(e) for e in collector.events] == [TextDelta, TextDelta, TextDelta, Finished]
    assert seen == [1, 2, 3, 3]  # after the prefill, after each decode


def test_a_failed_step_does_not_fail_requests_that_already_ended():
    """With overlapped output a request can end (max_tokens) with its last text not yet sent when the next step
    fails: it still gets its text and Finished; the requests still running get Failed."""

    class FailingEngine(FakeEngine):  # the device is lost after two decode steps: every later step fails too
        def decode(self, *args, **kwargs):
            if sum(call[0] == "decode" for call in self.calls) >= 2:
                raise RuntimeError("device lost")
            return super().decode(*args, **kwargs)

    engine = FailingEngine(n_slots=2)
    scheduler = Scheduler(engine, FakeTokenizer(), max_queue=4, prefill_chunk=8, overlap_output=True)
    short, long = Collector(), Collector()
    scheduler.submit(_request(3, 3, short))  # its 3rd token comes from the 2nd decode step
    scheduler.submit(_request(3, 10, long))
    run_until_done(scheduler, short, long)
    assert short.events == [TextDelta("f"), TextDelta("f"), TextDelta("f"), Finished("length", 3, 3)]
    assert isinstance(long.events[-1], Failed) and "device lost" in long.events[-1].message


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_request_whose_step_fails_fails_alone(smollm2, mixed, overlap):
    """A request the engine refuses (a token id outside the vocabulary, which the HTTP layer would have rejected)
    fails on its own: the requests batched with it still get the completions Generation gives them."""
    good = [smollm2.tokenizer.encode(p, add_special=True) for p in ("The capital of France is", "Water boils at")]
    expected = [smollm2.generate(ids, max_tokens=12, temperature=0, ignore_eos=True).run() for ids in good]
    scheduler = Scheduler(
        smollm2.engine, smollm2.tokenizer, max_queue=4, prefill_chunk=16, mixed_steps=mixed, overlap_output=overlap
    )
    collectors = [Collector() for _ in range(3)]
    params = SamplingParams(temperature=0)
    scheduler.submit(GenerationRequest(good[0], 12, params, collectors[0], ignore_eos=True))
    scheduler.submit(GenerationRequest([1, 10**6, 2], 12, params, collectors[1], ignore_eos=True))
    scheduler.submit(GenerationRequest(good[1], 12, params, collectors[2], ignore_eos=True))
    run_until_done(scheduler, *collectors, timeout=120)
    bad = collectors[1].events
    assert len(bad) == 1 and isinstance(bad[0], Failed) and "token ids must be in" in bad[0].message
    for collector, text in zip((collectors[0], collectors[2]), expected, strict=True):
        assert collector.events[-1] == Finished("length", len(good[collectors.index(collector) // 2]), 12)
        assert "".join(e.text for e in collector.events[:-1]) == text
