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
    def engine_sampleable(self) -> bool:
        """Greedy, or temperature and min-p without top-k/top-p filters, and no repetition penalty: an engine
        with a ``sample`` op can draw the token on the device (see Sampler.engine_row)."""
        filters = self.top_k != 0 or self.top_p < 1.0
        return self.repetition_penalty == 1.0 and (self.greedy or not filters)

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
        # The device draws' random stream: (seed, step) -> uniforms, the same on every backend (see `sample`).
        self.stream_seed = int(self.rng.integers(2**31)) if params.seed is None else int(params.seed) % 2**31
        self.engine_steps = 0

    def engine_row(self) -> np.ndarray:
        """This sequence's row of the ``sample`` op's parameters for its next token (then advances the step)."""
        row = engine_params(self.params.temperature, self.params.min_p, self.stream_seed, self.engine_steps % 2**31)
        self.engine_steps += 1
        return row

    def __call__(self, logits: np.ndarray, history: Iterable[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, history, p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        vocab = logits.shape[0]
        if (p.top_k == 0 or p.top_k >= vocab) and p.top_p >= 1.0:
            # No top-k/top-p filter: the engine's draw (~0.4 ms for 49k tokens, no sort), the same tokens the
            # device draws for this seed, so a seeded sequence repeats on every backend.
            return engine_draw(logits, self.engine_row())
        return self._draw(logits / np.float32(p.temperature))

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        vocab = logits.shape[0]
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


# -- the engine's draw (the `sample` op): Gumbel-max over a counter-based random stream ---------------------


def engine_params(temperature: float, min_p: float, seed: int, step: int) -> np.ndarray:
    """One row of the ``sample`` op's parameters: int32 [float32 bits of the temperature (0: greedy), float32
    bits of min_p, seed, step]."""
    floats = np.array([temperature, min_p], dtype=np.float32).view(np.int32)
    return np.array([floats[0], floats[1], seed, step], dtype=np.int32)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (lowbias32): the random stream is a hash of (seed, step, token index)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def stream_uniforms(seed: int, step: int, n: int) -> np.ndarray:
    """n float32 uniforms strictly inside (0, 1) of (seed, step) (int32 values, read as unsigned): what
    kernels/elementwise.cl's sample_rows computes. 23 bits, so (bits + 0.5) / 2^23 is exact in float32 and
    never rounds to 1 (which would make its Gumbel noise infinite and the token win regardless of its logit)."""
    seed_u, step_u = np.array([seed, step], dtype=np.int64).astype(np.int32).view(np.uint32)
    with np.errstate(over="ignore"):
        key = _mix(seed_u ^ _mix(step_u * np.uint32(0x9E3779B9) + np.uint32(0x632BE5AB)))
        bits = _mix(key ^ (np.arange(n, dtype=np.uint32) * np.uint32(0x85EBCA6B)))
    return ((bits >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def engine_draw(logits: np.ndarray, row: np.ndarray) -> int:
    """The token the ``sample`` op draws for one row of logits and one parameter row (Sampler.engine_row):
    greedy when the temperature is 0 (NumPy's argmax: a NaN wins), else the argmax of (logits - max) / T plus
    Gumbel noise over the tokens min-p keeps: an exact draw from softmax(logits / T) restricted to them. NaN
    logits never win a draw; subtracting the max first keeps tiny temperatures finite."""
    temperature, min_p = np.asarray(row[:2], dtype=np.int32).view(np.float32)
    logits = np.asarray(logits, dtype=np.float32)
    if temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # -inf/NaN/overflow are expected here
        top = np.nanmax(logits) if not np.isnan(logits).all() else np.float32(0)
        top = top if np.isfinite(top) else np.float32(0)  # as the kernel: an infinite max is not subtracted
        scaled = (logits - top) / np.float32(temperature)
        cut = np.log(np.float32(min_p)) if min_p > 0 else -np.inf
        gumbel = -np.log(-np.log(stream_uniforms(int(row[2]), int(row[3]), scaled.size)))
        keys = np.where(scaled >= cut, scaled + gumbel, -np.inf)  # NaN >= cut is False: NaN never wins
    return int(np.argmax(keys))
