"""Embeddings from a causal language model: the mean of the final-normed hidden states (the rows the output
projection reads) over every token of the input, L2-normalised to unit length.

Why the mean: these models were not trained to put a sentence into one token. The last token's state, which
embedding-trained decoders use, swings with how the text ends (a trailing period or not); the mean over
positions is steadier and is sentence-transformers' default for models without a pooling of their own. Unit
length makes the dot product the cosine similarity, as OpenAI's embeddings are.
"""

from __future__ import annotations

import numpy as np


class MeanPool:
    """Sums hidden rows as a prompt's chunks come in (float64), then gives their unit-length mean."""

    def __init__(self, dim: int):
        self.total = np.zeros(dim, dtype=np.float64)
        self.count = 0

    def add(self, rows: np.ndarray) -> None:
        self.total += np.asarray(rows, dtype=np.float64).sum(axis=0)
        self.count += len(rows)

    def vector(self) -> np.ndarray:
        """The (dim,) float32 embedding."""
        mean = self.total / max(self.count, 1)
        norm = float(np.linalg.norm(mean))
        return (mean / norm if norm > 0 else mean).astype(np.float32)


def embedding_of(hidden: np.ndarray) -> np.ndarray:
    """The embedding of one input from all its hidden rows (len, dim)."""
    pool = MeanPool(hidden.shape[1])
    pool.add(hidden)
    return pool.vector()
