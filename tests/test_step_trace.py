"""benchmarks/step_trace: the sitecustomize hook that times a server's scheduler steps, and its summary. It patches
scheduler and runtime methods by name, so a rename there must fail here rather than leave the tool silently
off (Python only prints a warning when a sitecustomize fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyopencl", reason="the hook also times the OpenCL runtime's replays")

TRACE_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "step_trace"

# A scheduler with overlapped output on SmolLM2 (NumPy): two requests, one starting while the other decodes.
RUN = """
import sys
import perfx_core
from perfx_core.sampling import SamplingParams
from perfx_core.serving.scheduler import GenerationRequest, Scheduler
sys.path.insert(0, {tests!r})
from scheduler_check import Collector, run_until_done

model = perfx_core.load({model!r}, backend="numpy", context_length=256, n_slots=2)
assert Scheduler._step.__name__ == "one_step", "the trace hook is not installed"
scheduler = Scheduler(model.engine, model.tokenizer, max_queue=2, prefill_chunk=16, overlap_output=True)
collectors = [Collector(), Collector()]
for words, collector in zip(("The capital of France is", "Once upon a time"), collectors):
    ids = model.tokenizer.encode(words, add_special=True)
    scheduler.submit(GenerationRequest(ids, 6, SamplingParams(temperature=0), collector))
run_until_done(scheduler, *collectors, timeout=120)
"""


def test_step_trace_records_each_step_and_its_text_sends(tmp_path, smollm2_path):
    trace = tmp_path / "steps.jsonl"
    env = {**os.environ, "PERFX_TRACE_STEPS": str(trace)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRACE_DIR), env.get("PYTHONPATH")]))
    code = RUN.format(tests=str(Path(__file__).parent), model=str(smollm2_path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Error in sitecustomize" not in run.stderr
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    # 2 prompts, 6 tokens each: at least 6 steps, every one with all its parts timed.
    assert len(steps) >= 6
    fields = {"total", "replay", "read", "take", "send", "gap", "sent", "start", "admitted", "submitted", "gc"}
    assert all(fields <= set(step) for step in steps)
    assert sum(step["submitted"] for step in steps) == 2 and sum(step["admitted"] for step in steps) == 2
    assert all(step["total"] > 0 and step["take"] >= 0 and step["send"] >= 0 for step in steps)
    sent = [step["sent"] for step in steps if step["sent"] is not None]
    assert len(sent) >= 6 and sent == sorted(sent)  # each step's text after the one before
    summary = subprocess.run(
        [sys.executable, str(TRACE_DIR / "summarize_steps.py"), str(trace)], capture_output=True, text=True
    )
    assert summary.returncode == 0, summary.stderr
