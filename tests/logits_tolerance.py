"""How close two computations of the same logits must be when they take different paths through the engine
(prefill in chunks or in one, a copied KV prefix, hidden states projected by hand).

The numba plugin's int8 GEMV (SmolLM2's Q8_0 output matrix, Gemma's Q8_0 and Q5_0 ones) rounds x to int16
steps of max |x| / 32767 per 32 columns. Hidden states that differ only by float rounding can land on
neighbouring steps, which moves a logit by up to ~1e-4 of the largest one (1.5e-3 seen at a largest logit of
~20). A wrong KV entry or a misplaced row moves logits by whole units.
"""

from __future__ import annotations

import numpy as np

FRACTION_OF_LARGEST = 2e-4


def assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    bound = FRACTION_OF_LARGEST * float(np.abs(want).max())
    worst = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert worst <= bound, f"logits differ by {worst:.3g}, more than {bound:.3g}"
