"""Runs the continuous-batching scheduler on a real model and checks its completions against Generation's (used by
the NumPy scheduler tests and the OpenCL ones)."""

from __future__ import annotations

import threading

from perfx_core.sampling import SamplingParams
from perfx_core.serving.scheduler import Finished, GenerationRequest, Scheduler, TextDelta


class Collector:
    """A request's events, with a flag for its end."""

    def __init__(self):
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if not isinstance(event, TextDelta):
            self.done.set()


def run_until_done(scheduler: Scheduler, *collectors: Collector, timeout: float = 10) -> None:
    """Start ``scheduler``, wait until every collector has its final event, and stop it (also on failure)."""
    scheduler.start()
    try:
        assert all(c.done.wait(timeout) for c in collectors)
    finally:
        scheduler.stop()


def check_overlapped_output(model, mixed: bool) -> None:
    """With overlap_output a step's text is handled after the next step is queued, so a stop string is found one
    step late: the sequence's extra token must not reach the text, the usage or the finish. Four SmolLM2 chat
    and text requests decoded together (ended by EOS, by stop strings, by max_tokens) get what Generation gives
    one at a time, with the overlap on and off."""
    chats = {"What is 2+2?": (), "Say hi.": ("help",), "Name a color.": ("indigo", "rare")}
    cases = [(model.chat_prompt_ids([{"role": "user", "content": q}]), stop, 40) for q, stop in chats.items()]
    cases.append((model.tokenizer.encode("The capital of France is", add_special=True), (), 9))
    expected = []
    for ids, stop, max_tokens in cases:
        generation = model.generate(ids, max_tokens=max_tokens, temperature=0, stop=stop)
        text = generation.run()
        stats = generation.stats
        expected.append((text, Finished(stats.finish_reason, len(ids), stats.generated_tokens)))
    # The cases end by EOS, two stop strings and max_tokens: each ending is covered.
    assert [f.finish_reason for _, f in expected] == ["stop", "stop", "stop", "length"]
    assert expected[1][0].endswith("here to ") and expected[2][0].endswith("is a ")

    for overlap in (False, True):
        scheduler = Scheduler(
            model.engine, model.tokenizer, max_queue=4, prefill_chunk=16, mixed_steps=mixed, overlap_output=overlap
        )
        collectors = [Collector() for _ in cases]
        for (ids, stop, max_tokens), collector in zip(cases, collectors, strict=True):
            scheduler.submit(GenerationRequest(ids, max_tokens, SamplingParams(temperature=0), collector, stop=stop))
        run_until_done(scheduler, *collectors, timeout=120)
        got = [("".join(e.text for e in c.events[:-1]), c.events[-1]) for c in collectors]
        assert got == expected, f"overlap_output={overlap}"
        assert scheduler.max_batch_size >= 3 and scheduler.running == 0 and scheduler.slots_used == 0
