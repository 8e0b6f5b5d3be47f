"""Sampler behaviour on controlled logits (exact expectations that a wrong filter would break)."""

from __future__ import annotations

import numpy as np
import pytest

from perfx_core import InvalidArgumentError
from perfx_core.sampling import Sampler, SamplingParams, apply_repetition_penalty

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draws(params: SamplingParams, n: int = 4000, logits=LOGITS, history=()):
    sampler = Sampler(params)
    return np.bincount([sampler(logits, history) for _ in range(n)], minlength=len(logits)) / n


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(np.array([0.1, 3.0, 2.9])) == 1


def test_plain_sampling_follows_the_distribution():
    freq = draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=0))
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_keeps_k_best():
    freq = draws(SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0, seed=1))
    assert freq[2] == freq[3] == 0
    np.testing.assert_allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_p():
    freq = draws(SamplingParams(temperature=1, top_k=0, top_p=0.8, min_p=0, seed=2))
    assert freq[2] == freq[3] == 0  # 0.5 + 0.3 reaches 0.8
    freq = draws(SamplingParams(temperature=1, top_k=0, top_p=0.81, min_p=0, seed=2))
    assert freq[2] > 0 and freq[3] == 0


def test_min_p_drops_tokens_below_fraction_of_best():
    freq = draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.2, seed=3))
    assert freq[3] == 0 and freq[2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15


def test_temperature_sharpens():
    cold = draws(SamplingParams(temperature=0.3, top_k=0, top_p=1, min_p=0, seed=4))
    assert cold[0] > 0.8


def test_seed_repeats():
    p = SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=9)
    a, b = Sampler(p), Sampler(p)
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]


def test_repetition_penalty():
    logits = np.array([2.0, -1.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -2.0, 1.0])
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=3.0))(logits, [0]) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")},
        {"top_k": 1.5},
        {"top_p": -0.1},
        {"top_p": 1e-50},  # 0 as the float32 the device gets: it would keep no token there
        {"min_p": -0.1},
        {"repetition_penalty": -1},
    ],
)
def test_invalid_params(kwargs):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_engine_uniforms_stay_inside_the_open_interval():
    """Every uniform of the draw's stream is strictly between 0 and 1 (a 1.0 would make its Gumbel noise
    infinite and its token win regardless of the logits)."""
    from perfx_core.sampling import stream_uniforms

    for seed, step in ((7, 395), (0, 0), (-5, 2**31 - 1), (2**31 - 1, 12345)):
        u = stream_uniforms(seed, step, 1 << 20)
        assert 0 < u.min() and u.max() < 1


def test_a_far_ahead_token_always_wins_the_draw():
    logits = np.full(49152, -30.0, np.float32)
    logits[0] = 30.0
    sampler = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=7))
    assert all(sampler(logits) == 0 for _ in range(400))


def test_filter_free_draws_are_the_engine_draws():
    """Without top-k/top-p the host sampler makes exactly the draws the engine's sample op makes for the same
    seed and step, so a seeded sequence repeats on every backend."""
    from perfx_core.sampling import engine_draw

    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1, min_p=0.02, seed=4)
    host, twin = Sampler(params), Sampler(params)
    assert [host(logits) for _ in range(50)] == [engine_draw(logits, twin.engine_row()) for _ in range(50)]


def test_tiny_temperature_is_the_argmax_and_nan_never_wins():
    from perfx_core.sampling import engine_draw

    logits = np.linspace(-1, 1, 50).astype(np.float32)
    row = Sampler(SamplingParams(temperature=1e-40, top_k=0, top_p=1, min_p=0, seed=1)).engine_row()
    assert engine_draw(logits, row) == 49
    logits[10] = np.nan
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0.5, seed=1))
    assert all(engine_draw(logits, sampler.engine_row()) != 10 for _ in range(20))


def test_engine_keep_matches_the_sorted_definition_and_keeps_ties():
    """engine_keep's value thresholds against the plain definition (sort, count k, accumulate to p), on random
    tempered logits; tied values at a threshold are all kept."""
    from perfx_core.sampling import engine_keep

    rng = np.random.default_rng(5)
    for trial in range(200):
        scaled = np.round(rng.standard_normal(300) * 2, 1).astype(np.float32)  # rounding makes ties common
        scaled -= scaled.max()
        k, p = int(rng.integers(0, 50)), float(rng.choice([1.0, rng.uniform(0.05, 0.99)]))
        order = np.argsort(-scaled, kind="stable")
        want = np.ones(300, bool)
        if 0 < k < 300:
            want &= scaled >= scaled[order[k - 1]]
        if p < 1.0:
            values = np.sort(scaled[want])[::-1]
            mass = np.cumsum(np.exp(values.astype(np.float64)))
            first = next(i for i in range(len(values)) if mass[i] >= p * mass[-1] * (1 - 2**-20))
            while first + 1 < len(values) and values[first + 1] == values[first]:
                first += 1  # a tie goes with its value
            want &= scaled >= values[first]
        np.testing.assert_array_equal(engine_keep(scaled, 0.0, k, p), want, err_msg=f"trial {trial}: k={k} p={p}")
