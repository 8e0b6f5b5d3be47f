"""Phi-3's long-context RoPE (LongRoPE: rope_type "longrope", formerly "su") in both formats, against
transformers' own forward pass on a tiny random checkpoint (tests/tiny_families.py: PHI3_LONGROPE, original
context 32, max_position_embeddings 128, non-trivial short and long factors).

perfx fixes the factor set by the context it is loaded with (long above the original context, short within it;
perfx_core/rope.py), transformers by the longest position of each forward call. The comparisons use sequences
on the same side of the original context as the loaded context, where the two must agree (NMSE < 1e-5), and one
test pins down what perfx does where they part: a short prompt on a long loaded context runs the long factors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_families as tf

from perfx_core.config import LongRope
from perfx_core.formats.hf import config_from_hf
from perfx_core.formats.hf_export import hf_config
from perfx_core.formats.perfx_format import config_from_json, config_to_json

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FORMATS = ("hf", *(f"gguf-{t}" for t in tf.GGUF_TYPES))
ORIGINAL = tf.LONGROPE_ORIGINAL  # 32
IDS = np.random.default_rng(0).integers(3, tf.VOCAB, 40).tolist()  # 40 > 32: transformers runs the long factors
SHORT_IDS = IDS[:24]  # within the original context: the short factors
LONG_CONTEXT, SHORT_CONTEXT = 64, ORIGINAL  # the context_length perfx is loaded with
TOLERANCE = 1e-5
SCALING = tf.PHI3_LONGROPE["rope_scaling"]
LONGROPE = "phi3-longrope"  # the checkpoint's name (tiny_families.Checkpoints)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tf.Checkpoints:
    return tf.Checkpoints(tmp_path_factory.mktemp("longrope"), {LONGROPE: ("phi3", tf.PHI3_LONGROPE)})


# -- the fixture ----------------------------------------------------------------------------------------------


def _params(checkpoints, **changes) -> dict:
    params = dict(transformers.AutoConfig.from_pretrained(checkpoints.hf(LONGROPE)).rope_parameters)
    return {**params, **changes}


# What a loader could get wrong, as a change of transformers' rope parameters, and the prompts it shows on.
CHANGES = {
    "no-scaling": (lambda c: {"rope_type": "default", "rope_theta": 10000.0}, (IDS, SHORT_IDS)),
    "short-factors-beyond-the-original": (lambda c: _params(c, long_factor=SCALING["short_factor"]), (IDS,)),
    "long-factors-within-the-original": (lambda c: _params(c, short_factor=SCALING["long_factor"]), (SHORT_IDS,)),
    "attention-factor-1": (lambda c: _params(c, attention_factor=1.0), (IDS, SHORT_IDS)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_fixture_longrope_changes_the_logits(checkpoints, change):
    """A loader that dropped the scaling, mixed up the two sets or left out the attention factor would be off by
    far more than the tolerance."""
    hf = checkpoints.hf(LONGROPE)
    params, prompts = CHANGES[change]
    changed = tf.reference_model(hf, rope_parameters=params(checkpoints))
    for ids in prompts:
        assert tf.nmse(tf.hf_logits(changed, ids), tf.hf_logits(tf.reference_model(hf), ids)) > 30 * TOLERANCE


# -- perfx against transformers -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_factors_match_transformers(checkpoints, fmt):
    """Loaded for 64 positions (> 32) with a 40-token prompt: both run the long factors."""
    path, reference = checkpoints.source(LONGROPE, fmt)
    expected = tf.hf_logits(reference, IDS)
    with tf.loaded(path, LONG_CONTEXT) as model:
        long_rope = model.config.long_rope
        ours = model.logits(IDS)
    assert long_rope is not None and long_rope.original_context_length == ORIGINAL
    assert long_rope.long_factors == pytest.approx(SCALING["long_factor"])
    assert long_rope.attn_factor == pytest.approx(np.sqrt(1 + np.log(128 / ORIGINAL) / np.log(ORIGINAL)))
    error = tf.nmse(ours, expected)
    assert error < TOLERANCE, f"{fmt}: NMSE {error:.2e} against transformers (long factors)"


@pytest.mark.parametrize("fmt", FORMATS)
def test_short_factors_match_transformers(checkpoints, fmt):
    """Loaded for 32 positions (the original context) with a 24-token prompt: both run the short factors."""
    path, reference = checkpoints.source(LONGROPE, fmt)
    expected = tf.hf_logits(reference, SHORT_IDS)
    with tf.loaded(path, SHORT_CONTEXT) as model:
        ours = model.logits(SHORT_IDS)
    error = tf.nmse(ours, expected)
    assert error < TOLERANCE, f"{fmt}: NMSE {error:.2e} against transformers (short factors)"


@pytest.mark.parametrize("fmt", ["hf", "gguf-F32"])
def test_the_loaded_context_picks_the_factors(checkpoints, fmt):
    """A short prompt on a long loaded context runs the long factors (llama.cpp's rule): its logits are the
    first rows of transformers' long-prompt forward, not transformers' own forward of the short prompt."""
    path, reference = checkpoints.source(LONGROPE, fmt)
    long_rows = tf.hf_logits(reference, IDS)[: len(SHORT_IDS)]  # causal: rows of the 40-token forward
    with tf.loaded(path, LONG_CONTEXT) as model:
        ours = model.logits(SHORT_IDS)
    assert tf.nmse(ours, long_rows) < TOLERANCE
    assert tf.nmse(ours, tf.hf_logits(reference, SHORT_IDS)) > 30 * TOLERANCE


@pytest.mark.parametrize("fmt", ["hf", "gguf-F32"])
def test_greedy_generation_matches_transformers(checkpoints, fmt):
    """A 36-token prompt (past the original context) and 8 new tokens: the long factors throughout, in both."""
    path, reference = checkpoints.source(LONGROPE, fmt)
    prompt, n_new = IDS[:36], 8
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, return_dict_in_generate=True,
            output_scores=True, pad_token_id=tf.UNK,
        )  # fmt: skip
    theirs = out.sequences[0, len(prompt) :].tolist()
    with tf.loaded(path, LONG_CONTEXT) as model:
        generation = model.generate(prompt, max_tokens=n_new, temperature=0, ignore_eos=True)
        generation.run()
        ours = list(generation.token_ids)
    assert len(ours) == len(theirs) == n_new
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:  # only a near-tie in transformers' own logits excuses a different pick
            top2 = torch.topk(out.scores[step][0].double(), 2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"step {step}: {ours} != {theirs}"
            break


def test_su_config_reads_as_longrope(checkpoints, tmp_path):
    """Phi-3's first 128k configs: rope_scaling with "type": "su" (transformers reads it as longrope; version 5
    wants the original context inside it too, which perfx takes from the top-level key)."""
    factors = {"short_factor": SCALING["short_factor"], "long_factor": SCALING["long_factor"]}
    su = {"type": "su", **factors, "original_max_position_embeddings": ORIGINAL}
    edited = tf.edit_checkpoint(
        checkpoints.hf(LONGROPE),
        tmp_path / "su",
        config={"rope_parameters": None, "rope_scaling": su, "rope_theta": 1e4},
    )
    expected = tf.hf_logits(tf.reference_model(edited), IDS)
    with tf.loaded(edited) as model:
        assert model.config.long_rope.short_factors == pytest.approx(SCALING["short_factor"])
        ours = model.logits(IDS)
    assert tf.nmse(ours, expected) < TOLERANCE


def test_config_round_trips_through_perfx_json_and_config_json(checkpoints):
    config = config_from_hf(
        json.loads((checkpoints.hf(LONGROPE) / "config.json").read_text()), str(checkpoints.hf(LONGROPE))
    )
    assert isinstance(config.long_rope, LongRope)
    assert config_from_json(config_to_json(config), "perfx-dir") == config
    # hf_export writes a Llama config.json; the scaling goes with it, attention factor spelled out
    exported = config_from_hf(hf_config(config, np.dtype(np.float32)), "exported")
    assert exported.long_rope == config.long_rope


# -- malformed scaling ----------------------------------------------------------------------------------------


def _rope_parameters(**changes):
    return lambda checkpoints: {"rope_parameters": _params(checkpoints, **changes)}


BAD_HF = {
    "long-factor-length": (
        _rope_parameters(long_factor=[1.0] * 7),
        ("'rope_parameters.long_factor' must be 8 positive numbers", "got 7 values"),
    ),
    "zero-short-factor": (
        _rope_parameters(short_factor=[1.0] * 7 + [0.0]),
        ("'rope_parameters.short_factor' must be 8 positive numbers",),
    ),
    "unknown-type": (
        _rope_parameters(rope_type="dynamic"),
        ("'dynamic'", "rope_parameters.rope_type", "not supported"),
    ),
    "attention-factor-text": (
        _rope_parameters(attention_factor="1.2"),
        ("'rope_parameters.attention_factor' is '1.2' (str)", "positive number"),
    ),
    "partial-rotary": (_rope_parameters(partial_rotary_factor=0.75), ("partial_rotary_factor", "whole heads")),
    "original-context-zero": (
        lambda c: {"original_max_position_embeddings": 0},
        ("'original_max_position_embeddings' is 0", "an integer in 2.."),
    ),
}


@pytest.mark.parametrize("case", BAD_HF)
def test_malformed_longrope_is_refused_hf(checkpoints, tmp_path, case):
    edit, facts = BAD_HF[case]
    tf.refused(tf.edit_checkpoint(checkpoints.hf(LONGROPE), tmp_path / "bad", config=edit(checkpoints)), *facts)


def test_missing_factor_set_is_refused_hf(checkpoints, tmp_path):
    params = _params(checkpoints)
    del params["short_factor"]
    bad = tf.edit_checkpoint(checkpoints.hf(LONGROPE), tmp_path / "bad", config={"rope_parameters": params})
    tf.refused(bad, "lacks the required key 'rope_parameters.short_factor'")


BAD_GGUF = {
    "long-factors-length": (
        lambda t: t.__setitem__("rope_factors_long.weight", np.ones(7, np.float32)),
        ("'rope_factors_long.weight' must be 8 positive numbers", "got 7 values"),
    ),
    "negative-short-factor": (
        lambda t: t.__setitem__("rope_factors_short.weight", -np.ones(8, np.float32)),
        ("'rope_factors_short.weight' must be 8 positive numbers",),
    ),
    "short-factors-missing": (
        lambda t: t.pop("rope_factors_short.weight"),
        ("lacks the required key 'rope_factors_short.weight'",),
    ),
    "factors-2d": (
        lambda t: t.__setitem__("rope_factors_long.weight", np.ones((2, 4), np.float32)),
        ("'rope_factors_long.weight' has shape", "head size / 2"),
    ),
}


@pytest.mark.parametrize("case", BAD_GGUF)
def test_malformed_longrope_is_refused_gguf(checkpoints, tmp_path, case):
    edit, facts = BAD_GGUF[case]
    path = tmp_path / "bad.gguf"
    tf.write_gguf(checkpoints.hf(LONGROPE), path, edit=edit)
    tf.refused(path, *facts)


def test_bad_attention_factor_key_is_refused_gguf(checkpoints, tmp_path):
    path = tmp_path / "bad.gguf"
    tf.write_gguf(checkpoints.hf(LONGROPE), path, metadata={"phi3.rope.scaling.attn_factor": -1.0})
    tf.refused(path, "'phi3.rope.scaling.attn_factor' is -1.0", "positive number")
