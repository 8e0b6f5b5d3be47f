"""When a queue is flushed: the one policy of the Python launch path (runtime.py) and the native replayer
(native_replay.py), which must queue a recorded step exactly as Python would."""

from __future__ import annotations

FLUSH_EVERY = 16  # launches between queue flushes: some drivers (NVIDIA's) hold queued kernels until a flush
# A replayed step also flushes after these of its launches (counting from 1): the device, idle since the last
# step's rows were read, starts on the first kernels instead of waiting for FLUSH_EVERY enqueues (~12 us each on
# NVIDIA). H200: wall minus device time per step 0.23 -> 0.14 ms at batch 1
# (docs/results/h200_profile_steps_early_flushes.jsonl).
REPLAY_EARLY_FLUSHES = frozenset({1, 2, 4, 8})


def flushes_after(launch: int) -> bool:
    """Whether a replayed step flushes right after its ``launch``-th launch (counting from 1)."""
    return launch % FLUSH_EVERY == 0 or launch in REPLAY_EARLY_FLUSHES
