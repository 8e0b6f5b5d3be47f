"""Log-probabilities of tokens under the model's raw distribution (before temperature or any filter), as the
OpenAI API reports them: the chosen token's, and the ``top`` most likely alternatives at that position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: the first token of a prompt, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise, in float64: scores of long prompts are sums of many such values."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: np.ndarray | list[int], top: int) -> list[TokenLogprob]:
    """One entry per row of ``logits`` (rows, vocab): the log-probability of ``tokens[i]`` under row i, and
    the ``top`` best tokens of that row."""
    logp = log_softmax(np.atleast_2d(logits))
    tokens = np.asarray(tokens, dtype=np.int64)
    chosen = logp[np.arange(len(tokens)), tokens]
    entries = []
    for i, token in enumerate(tokens.tolist()):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            ids = np.argpartition(-logp[i], top - 1)[:top]
            ids = ids[np.argsort(-logp[i, ids], kind="stable")]
            best = tuple((int(t), float(logp[i, t])) for t in ids)
        entries.append(TokenLogprob(int(token), float(chosen[i]), best))
    return entries
