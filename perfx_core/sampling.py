"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seed.

Order (as in Hugging Face transformers): the logit adjustments (repetition penalty over prompt and output,
OpenAI's frequency and presence penalties over the output, logit bias, and end tokens masked until min_tokens),
a grammar's mask (structured output: perfx_core.grammar), temperature, then top-k, top-p and min-p filters on
the tempered distribution, then a seeded draw. Temperature 0 means greedy.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import defaults
from .errors import InvalidArgumentError

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K  # 0 disables
    top_p: float = defaults.TOP_P  # 1.0 disables
    min_p: float = defaults.MIN_P  # 0.0 disables
    repetition_penalty: float = defaults.REPETITION_PENALTY  # 1.0 disables
    seed: int | None = None
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # end tokens (Sampler's end_ids) cannot be drawn before this many were generated

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidArgumentError(f"{name} must be a number; got {value!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 is greedy); got {self.temperature}")
        if not np.isfinite(np.float32(self.temperature)):  # it travels to the device as a float32
            raise InvalidArgumentError(f"temperature must be at most {FLOAT32_MAX:.3g}; got {self.temperature}")
        # top_k travels to the device as an int32: a larger value would not fit (and keeps every token anyway).
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, (int, np.integer))
            or not 0 <= self.top_k <= INT32_MAX
        ):
            raise InvalidArgumentError(
                f"top_k must be an integer in [0, {INT32_MAX}] (0 disables it); got {self.top_k!r}"
            )
        if not 0 < self.top_p <= 1 or np.float32(self.top_p) == 0:  # it travels to the device as a float32
            raise InvalidArgumentError(f"top_p must be in (0, 1] and at least 1.2e-38 (float32); got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise InvalidArgumentError(f"min_p must be in [0, 1); got {self.min_p}")
        if not np.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidArgumentError(f"repetition_penalty must be > 0 (1 disables it); got {self.repetition_penalty}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, (int, np.integer))
            or not 0 <= self.seed <= UINT64_MAX
        ):
            raise InvalidArgumentError(f"seed must be an integer in [0, 2**64); got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgumentError(f"{name} must be in [-2, 2]; got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
            isinstance(t, (int, np.integer)) and t >= 0 and isinstance(b, numbers.Real) and -100 <= b <= 100
            for t, b in self.logit_bias
        ):
            raise InvalidArgumentError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, (int, np.integer))
            or self.min_tokens < 0
        ):
            raise InvalidArgumentError(f"min_tokens must be an integer >= 0; got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, bias or min_tokens change the logits on the host before the draw."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def engine_sampleable(self) -> bool:
        """No logit adjustment (the penalties need the history): an engine with a ``sample`` op can then pick the
        token on the device, greedy or drawn with every filter (see Sampler.engine_row)."""
        return not self.adjusts_logits

    @property
    def plain_argmax(self) -> bool:
        """The next token is the argmax of the raw logits (greedy, no repetition penalty): the engine can pick
        it on the device and send back one id instead of the logits."""
        return self.greedy and not self.adjusts_logits


class TokenConstraint(Protocol):
    """A grammar's hold on one sequence (perfx_core.grammar.TokenConstraint): the tokens allowed next."""

    def mask_logits(self, logits: np.ndarray) -> np.ndarray: ...
    def accept(self, token: int) -> None: ...
    @property
    def complete(self) -> bool: ...


class Sampler:
    """Samples token ids for one sequence from its own random stream (seed, step), so runs repeat with a seed.
    With a ``constraint`` (structured output), the tokens it does not allow next are masked out of every draw
    (after the logit adjustments, before temperature and the filters), and each drawn token advances it."""

    def __init__(self, params: SamplingParams, end_ids: Iterable[int] = (), constraint: TokenConstraint | None = None):
        self.params = params
        self.constraint = constraint
        self.end_ids_set = frozenset(end_ids)  # tokens that end the sequence: masked until params.min_tokens
        self.end_ids = np.fromiter(sorted(self.end_ids_set), dtype=np.int64)
        # The draws' random stream: (seed, step) -> uniforms, the same on every backend (see `sample`); without
        # a seed, a fresh one.
        seed = params.seed if params.seed is not None else np.random.default_rng().integers(2**31)
        self.stream_seed = int(seed) % 2**31
        self.engine_steps = 0

    def engine_row(self) -> np.ndarray:
        """This sequence's row of the ``sample`` op's parameters for its next token (then advances the step)."""
        p = self.params
        row = engine_params(p.temperature, p.min_p, self.stream_seed, self.engine_steps % 2**31, p.top_k, p.top_p)
        self.engine_steps += 1
        return row

    def __call__(self, logits: np.ndarray, history: Iterable[int] = (), generated: Sequence[int] = ()) -> int:
        """The next token: after the logit adjustments (``history``: prompt and output, for the repetition
        penalty; ``generated``: the output so far), the engine's draw (engine_draw), the same tokens a device's
        ``sample`` op draws for this seed, so a seeded sequence repeats on every backend."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.adjusts_logits:
            logits = self.adjust(logits, history, generated)
        if self.constraint is not None:
            logits = self.constraint.mask_logits(logits)
        token = int(np.argmax(logits)) if p.greedy else engine_draw(logits, self.engine_row())
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    @property
    def constrained(self) -> bool:
        """A grammar picks the allowed tokens: every draw needs the logits (no engine-side picks)."""
        return self.constraint is not None

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more after the last token drawn: the sequence ends there."""
        return self.constraint is not None and self.constraint.complete

    def adjust(self, logits: np.ndarray, history: Iterable[int], generated: Sequence[int]) -> np.ndarray:
        p = self.params
        logits = logits.copy()  # the caller's row may be an engine buffer
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, history, p.repetition_penalty)
        vocab = logits.shape[-1]
        if (p.frequency_penalty or p.presence_penalty) and len(generated):
            counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=vocab)[:vocab]
            logits -= (p.frequency_penalty * counts + p.presence_penalty * (counts > 0)).astype(np.float32)
        for token, bias in p.logit_bias:
            if token < vocab:
                logits[token] += np.float32(bias)
        if len(generated) < p.min_tokens and self.end_ids.size:
            logits[self.end_ids[self.end_ids < vocab]] = -np.inf
        return logits


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


ENGINE_ROW = 6  # int32 values per row of the ``sample`` op's parameters
# A prefix "reaches" top_p when its mass is within float rounding of it (top_p travels as a float32: 0.8 is
# 0.80000001, which 0.5 + 0.3 would otherwise miss); the kernel uses the same factor.
TOP_P_SLACK = 1.0 - 2.0**-20


def engine_params(
    temperature: float, min_p: float, seed: int, step: int, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """One row of the ``sample`` op's parameters: int32 [float32 bits of the temperature (0: greedy), float32
    bits of min_p, seed, step, top_k (0: off), float32 bits of top_p (1: off)]."""
    floats = np.array([temperature, min_p, top_p], dtype=np.float32).view(np.int32)
    return np.array([floats[0], floats[1], seed, step, top_k, floats[2]], dtype=np.int32)


def _order_keys(values: np.ndarray) -> np.ndarray:
    """uint32 keys in the order of the float32 values (NaN: 0, below everything): what the kernel searches."""
    bits = values.astype(np.float32).view(np.uint32)
    keys = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    return np.where(np.isnan(values), np.uint32(0), keys)


def engine_keep(scaled: np.ndarray, min_p: float, top_k: int, top_p: float) -> np.ndarray:
    """The tokens a draw may pick, from the tempered logits ``scaled`` (max 0): those at or above the k-th
    largest value (ties kept), then at or above the value where the mass of the larger ones, over what top-k
    kept, first reaches top_p (ties kept: the smallest prefix reaching p), and within min-p of the best.
    Thresholds on values, so a device finds them with searches over the values instead of a sort."""
    keys = _order_keys(scaled)
    keep = keys > 0
    if 0 < top_k < int(keep.sum()):
        keep &= keys >= np.sort(keys[keep])[-top_k]
    if top_p < 1.0 and keep.any():
        values = np.sort(scaled[keep])[::-1]
        mass = np.cumsum(np.exp(values.astype(np.float64)))
        last_of_tie = np.append(values[1:] != values[:-1], True)  # a value's mass includes all its ties
        reached = np.flatnonzero(last_of_tie & (mass >= np.float64(top_p) * mass[-1] * TOP_P_SLACK))
        if reached.size:
            keep &= scaled >= values[reached[0]]
    if min_p > 0:
        keep &= scaled >= np.log(np.float32(min_p))
    return keep


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
    Gumbel noise over the tokens top-k, top-p and min-p keep (engine_keep): an exact draw from softmax(logits
    / T) restricted to them. NaN logits never win a draw; subtracting the max first keeps tiny temperatures
    finite."""
    row = np.asarray(row, dtype=np.int32)
    temperature, min_p, top_p = row[[0, 1, 5]].view(np.float32)
    top_k = int(row[4])
    logits = np.asarray(logits, dtype=np.float32)
    if temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # -inf/NaN/overflow are expected here
        top = np.nanmax(logits) if not np.isnan(logits).all() else np.float32(0)
        top = top if np.isfinite(top) else np.float32(0)  # as the kernel: an infinite max is not subtracted
        scaled = (logits - top) / np.float32(temperature)
        gumbel = -np.log(-np.log(stream_uniforms(int(row[2]), int(row[3]), scaled.size)))
        keys = np.where(engine_keep(scaled, float(min_p), top_k, float(top_p)), scaled + gumbel, -np.inf)
    return int(np.argmax(keys))
