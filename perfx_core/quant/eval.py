"""Perplexity of a loaded model on a text, with sliding windows (the same for every format and backend)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    tokens: int  # tokens scored
    nll: float  # mean negative log-likelihood (nats per token)


def perplexity_of_ids(
    logits_fn: Callable[[list[int]], np.ndarray], ids: list[int], ctx: int, stride: int
) -> PerplexityResult:
    """Windows of ``ctx`` tokens starting every ``stride`` tokens; each scores only the tokens no earlier window
    scored (so every token after the first is scored exactly once, with up to ctx - 1 tokens of context)."""
    if ctx < 2 or not 1 <= stride <= ctx:
        raise InvalidArgumentError(f"perplexity needs ctx >= 2 and 1 <= stride <= ctx; got ctx={ctx}, stride={stride}")
    if len(ids) < 2:
        raise InvalidArgumentError("the text is too short: perplexity needs at least 2 tokens")
    total, count, scored_to = 0.0, 0, 1  # token 0 has no prediction
    begin = 0
    while scored_to < len(ids):
        end = min(begin + ctx, len(ids))
        window = ids[begin:end]
        logits = np.asarray(logits_fn(window), dtype=np.float64)  # row j predicts window[j + 1]
        first = scored_to - begin  # position in the window of the first new target
        rows = logits[first - 1 : end - begin - 1]
        targets = np.asarray(window[first:], dtype=np.int64)
        peak = rows.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
        total += float(np.sum(log_z - rows[np.arange(len(targets)), targets]))
        count += len(targets)
        scored_to = end
        begin += stride
        # A window must start before its first target, so that the target has a prediction (stride == ctx).
        begin = min(begin, scored_to - 1)
    nll = total / count
    return PerplexityResult(float(np.exp(nll)), count, nll)


def perplexity(
    model: Any, text: str, ctx: int = 512, stride: int | None = None, add_bos: bool = True
) -> PerplexityResult:
    """Perplexity of ``model`` (a perfx Model: anything with ``tokenizer`` and ``logits(ids)``) on ``text``.

    ``stride`` defaults to ctx // 2. The text is tokenized once, with BOS when the model's tokenizer adds one.
    """
    ids = model.tokenizer.encode(text, add_special=add_bos)
    ctx = min(ctx, getattr(model, "context_length", ctx))
    return perplexity_of_ids(model.logits, ids, ctx, stride if stride is not None else max(1, ctx // 2))
