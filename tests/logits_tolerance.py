"""How close two computations of the same logits must be when they take different paths through the engine
(prefill in chunks or in one, a copied KV prefix, hidden states projected by hand).

Up to 32 rows of x, the numba plugin's int4 and int8 GEMVs round x to int16 steps of max |x| / 32767 per group of
columns; larger batches go through BLAS in float32. Two paths that differ in batch sizes or only by float rounding
then give logits up to ~4e-4 of the largest one apart (SmolLM2, 100 tokens, int16 kernels against the float
reference: 0.0128 at a largest logit of 32.3, NMSE 1.8e-8, every top-1 the same). A wrong KV entry or a
misplaced row moves logits by whole units.
"""

from __future__ import annotations

import numpy as np

FRACTION_OF_LARGEST = 1e-3


def assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    bound = FRACTION_OF_LARGEST * float(np.abs(want).max())
    worst = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert worst <= bound, f"logits differ by {worst:.3g}, more than {bound:.3g}"
