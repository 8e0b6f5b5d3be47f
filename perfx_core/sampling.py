"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

Order (as in Hugging Face transformers): repetition penalty, temperature, then top-k, top-p and min-p
filters on the tempered distribution, then a seeded draw. Temperature 0 means greedy.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repetition_penalty: float = 1.0  # 1.0 disables
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidArgumentError(f"{name} must be a number; got {value!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 is greedy); got {self.temperature}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 disables it); got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1]; got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise InvalidArgumentError(f"min_p must be in [0, 1); got {self.min_p}")
        if not np.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidArgumentError(f"repetition_penalty must be > 0 (1 disables it); got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise InvalidArgumentError(f"seed must be a non-negative integer; got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_argmax(self) -> bool:
        """The next token is the argmax of the raw logits (greedy, no repetition penalty): the engine can pick
        it on the device and send back one id instead of the logits."""
        return self.greedy and self.repetition_penalty == 1.0


class Sampler:
    """Samples token ids for one sequence; holds its own random generator so runs repeat with a seed."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Iterable[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, history, p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        return self._draw(logits / np.float32(p.temperature))

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        vocab = logits.shape[0]
        if (p.top_k == 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p == 0:
            # No filter: draw from a cumulative sum (~0.3 ms for 49k tokens) instead of sorting (~6 ms).
            weights = np.exp((logits - logits.max()).astype(np.float64))
            cumulative = np.cumsum(weights)
            drawn = np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right")
            return int(min(drawn, vocab - 1))
        # Candidates sorted by logit, best first; top-k limits how many we ever look at.
        if 0 < p.top_k < vocab:
            cand = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        else:
            cand = np.arange(vocab)
        cand = cand[np.argsort(-logits[cand], kind="stable")]
        probs = np.exp((logits[cand] - logits[cand[0]]).astype(np.float64))
        probs /= probs.sum()
        keep = len(cand)
        if p.top_p < 1.0:
            # Smallest prefix whose mass reaches top_p (always at least one token).
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(cand[self.rng.choice(keep, p=probs)])


def apply_repetition_penalty(logits: np.ndarray, history: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty: seen tokens' positive logits are divided by ``penalty``, negative ones multiplied."""
    seen = np.unique(np.fromiter(history, dtype=np.int64))
    if seen.size == 0:
        return logits
    out = logits.copy()
    values = out[seen]
    out[seen] = np.where(values > 0, values / penalty, values * penalty)
    return out
