"""The server records the rest of its warm-up while idle (Scheduler idle_work): the real SmolLM2 engine's warm-up
steps run between requests, pause while a request runs, and leave every completion as it is without them (the
warm-up writes garbage into the slots, which the prefix cache must notice)."""

from __future__ import annotations

import threading
import time

from scheduler_check import Collector

from perfx_core.sampling import SamplingParams
from perfx_core.serving.scheduler import Finished, GenerationRequest, Scheduler, TextDelta


def _complete(scheduler: Scheduler, ids: list[int], max_tokens: int = 8) -> tuple[str, Finished]:
    collector = Collector()
    scheduler.submit(GenerationRequest(ids, max_tokens, SamplingParams(temperature=0), collector))
    assert collector.done.wait(60)
    *deltas, end = collector.events
    assert all(isinstance(d, TextDelta) for d in deltas) and isinstance(end, Finished)
    return "".join(d.text for d in deltas), end


def test_idle_work_runs_between_requests_and_changes_no_completion(smollm2):
    ids = smollm2.chat_prompt_ids([{"role": "user", "content": "Name a color."}])
    reference = Scheduler(smollm2.engine, smollm2.tokenizer, max_queue=4, prefill_chunk=64)
    reference.start()
    try:
        want = _complete(reference, ids)
    finally:
        reference.stop()

    steps: list[tuple[str, int]] = []  # (label, requests running when the step ran)
    gate = threading.Event()  # the steps after the first few wait for the test's first request to end

    def warm_up():
        """Decode steps over every slot, as the engine's warm-up records them (its prefills would only add
        numba compile time here)."""
        engine = smollm2.engine
        for i in range(8):
            batch = 1 + i % engine.n_slots
            engine.decode([0] * batch, list(range(batch)), [i] * batch, argmax=True)
            steps.append(("decode", scheduler.running))
            yield "record"
            if i == 2:
                gate.wait(30)

    scheduler = Scheduler(smollm2.engine, smollm2.tokenizer, max_queue=4, prefill_chunk=64, idle_work=warm_up())
    scheduler.start()
    try:
        deadline = time.monotonic() + 30
        while len(steps) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(steps) == 3, "idle work did not start while the scheduler was idle"
        threading.Timer(0.2, gate.set).start()  # the idle step blocks the loop 0.2 s; the request then waits
        got_first = _complete(scheduler, ids)  # same prompt: its slot's cache was overwritten by the warm-up
        deadline = time.monotonic() + 60
        while scheduler.idle_work_left and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scheduler.idle_work_left, "the idle work did not run to its end"
        got_after = _complete(scheduler, ids)
    finally:
        scheduler.stop()
    assert got_first == want and got_after == want
    assert len(steps) > 3 and all(running == 0 for _, running in steps), "an idle step ran next to a request"
