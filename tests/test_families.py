"""Model families next to Llama (Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3), in both formats, against
transformers' own forward pass on the same tiny random checkpoints (tests/tiny_families.py builds them).

Four kinds of test:
- the fixtures themselves: each family's distinctive setting changes transformers' logits by far more than the
  tolerance (so a loader ignoring it fails), and transformers' own GGUF reader finds our GGUF files to be the
  checkpoint (so a failure below is perfx's, not the writer's);
- perfx's logits over 40 tokens (5x the sliding window) against transformers' (float32, eager): NMSE < 1e-5;
- perfx's greedy generation against transformers' greedy generation;
- checkpoints whose config and tensors disagree: perfx_core.ModelFormatError naming both facts.

Not marked slow, so the default suite runs it: tiny models, a few seconds per family.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_families as tf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FORMATS = ("hf", *(f"gguf-{t}" for t in tf.GGUF_TYPES))
IDS = np.random.default_rng(0).integers(3, tf.VOCAB, 40).tolist()  # past the specials; 40 > 5 windows of 8
TOLERANCE = 1e-5
N_NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tf.Checkpoints:
    return tf.Checkpoints(tmp_path_factory.mktemp("families"))


# -- the fixtures ---------------------------------------------------------------------------------------------

# (family, what is switched off or changed in transformers' config): each must move the logits.
FEATURES = [
    ("mistral", {"sliding_window": None}),
    ("phi3", {"sliding_window": None}),
    ("gemma2", {"sliding_window": 4096}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 32}),  # = head_dim
    ("gemma3", {"sliding_window": 4096}),
    ("gemma3", {"query_pre_attn_scalar": 32}),
    ("gemma3", {"layer_types": ["sliding_attention"] * 6}),  # no global layer
]


@pytest.mark.parametrize(("family", "change"), FEATURES, ids=lambda v: v if isinstance(v, str) else next(iter(v)))
def test_fixture_features_change_the_logits(checkpoints, family, change):
    """A loader that ignored this setting would be off by far more than the tolerance."""
    hf = checkpoints.hf(family)
    base = tf.hf_logits(tf.reference_model(hf), IDS)
    assert tf.nmse(tf.hf_logits(tf.reference_model(hf, **change), IDS), base) > 30 * TOLERANCE


def test_fixture_gemma3_local_rope_base_changes_the_logits(checkpoints):
    hf = checkpoints.hf("gemma3")
    config = transformers.AutoConfig.from_pretrained(hf)
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 2500.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    base = tf.hf_logits(tf.reference_model(hf), IDS)
    local = {**config.rope_parameters, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert tf.nmse(tf.hf_logits(tf.reference_model(hf, rope_parameters=local), IDS), base) > 30 * TOLERANCE


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", tf.FAMILIES)
def test_gguf_fixture_reads_back_in_transformers(checkpoints, family, tensor_type):
    """transformers' GGUF reader (names, q/k un-permutation, Gemma's norm - 1, Q8_0 decoding) turns our file
    back into the reference model. Its config mapping lacks a few keys; those are filled in from the file's own
    metadata the way llama.cpp reads them (key_length as head size and Gemma's q.k scale, the soft-caps, Phi-3's
    sliding_window)."""
    import gguf

    path, decoded = checkpoints.gguf(family, tensor_type)
    reader = gguf.GGUFReader(str(path))
    arch = reader.get_field("general.architecture").contents()
    meta = {f.name[len(arch) + 1 :]: f.contents() for f in reader.fields.values() if f.name.startswith(arch + ".")}
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if "attention.key_length" in meta:
        config.head_dim = meta["attention.key_length"]
    if arch in ("gemma2", "gemma3"):
        config.query_pre_attn_scalar = meta["attention.key_length"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key in meta:
            setattr(config, key, meta[key])
    if arch == "phi3":
        config.sliding_window = meta["attention.sliding_window"] or None
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference = tf.reference_model(checkpoints.hf(family), view_as_gguf=True, weights=decoded)
    assert tf.nmse(tf.hf_logits(theirs, IDS), tf.hf_logits(reference, IDS)) < 1e-10


@pytest.mark.parametrize("fmt", ["hf", "gguf-F32"])
def test_fixture_tokenizer_is_transformers_own(checkpoints, fmt):
    """perfx reads the fixture's vocabulary (tokenizer.json, or the GGUF's tokenizer.ggml.*) as transformers does."""
    text = "hello there, the hat is on the chair <|im_end|>"
    expected = transformers.AutoTokenizer.from_pretrained(checkpoints.hf("qwen2")).encode(text)
    path = checkpoints.hf("qwen2") if fmt == "hf" else checkpoints.gguf("qwen2", "F32")[0]
    with tf.loaded(path) as model:
        assert model.tokenizer.vocab_size == tf.VOCAB
        assert model.tokenizer.encode(text, parse_special=True) == expected


# -- perfx against transformers -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", tf.FAMILIES)
def test_logits_match_transformers(checkpoints, family, fmt):
    path, reference = checkpoints.source(family, fmt)
    expected = tf.hf_logits(reference, IDS)
    with tf.loaded(path) as model:
        ours = model.logits(IDS)
    assert ours.shape == expected.shape == (len(IDS), tf.VOCAB)
    error = tf.nmse(ours, expected)
    assert error < TOLERANCE, f"{family} ({fmt}): NMSE {error:.2e} against transformers"


@pytest.mark.parametrize("fmt", ["hf", "gguf-F32"])
@pytest.mark.parametrize("family", tf.FAMILIES)
def test_greedy_generation_matches_transformers(checkpoints, family, fmt):
    path, reference = checkpoints.source(family, fmt)
    prompt = IDS[:12]  # generation runs past the window of 8
    reference.generation_config.eos_token_id = None  # both run the full N_NEW tokens
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, return_dict_in_generate=True,
            output_scores=True, pad_token_id=tf.UNK,
        )  # fmt: skip
    theirs = out.sequences[0, len(prompt) :].tolist()
    assert len(theirs) == N_NEW
    with tf.loaded(path) as model:
        generation = model.generate(prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True)
        generation.run()
        ours = list(generation.token_ids)
    assert len(ours) == N_NEW
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            # Only a near-tie in transformers' own logits excuses a different pick (and ends the comparison).
            top2 = torch.topk(out.scores[step][0].double(), 2).values
            margin = float(top2[0] - top2[1])
            why = f"step {step}: perfx picked {a}, transformers {b} (margin {margin:.3g}): {ours} != {theirs}"
            assert margin < 1e-3, why
            break


# -- config and tensors that disagree -------------------------------------------------------------------------


def _bad_hf(checkpoints, tmp_path, family, **edits) -> Path:
    return tf.edit_checkpoint(checkpoints.hf(family), tmp_path / "bad", **edits)


def _bad_gguf(checkpoints, tmp_path, family, edit) -> Path:
    path = tmp_path / "bad.gguf"
    tf.write_gguf(checkpoints.hf(family), path, edit=edit)
    return path


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _put(name, value):
    return lambda tensors: tensors.__setitem__(name, np.asarray(value, np.float32))


# (family, Hugging Face tensor, GGUF tensor): a norm or bias the family's config says its blocks have
MISSING = [
    ("gemma2", "model.layers.1.post_feedforward_layernorm.weight", "blk.1.post_ffw_norm.weight"),
    ("gemma3", "model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
    ("qwen3", "model.layers.1.self_attn.k_norm.weight", "blk.1.attn_k_norm.weight"),
    ("qwen2", "model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),  # not to be read as zero
]


@pytest.mark.parametrize(("family", "hf_name", "gguf_name"), MISSING, ids=[c[0] for c in MISSING])
def test_missing_tensor_is_refused_hf(checkpoints, tmp_path, family, hf_name, gguf_name):
    tf.refused(_bad_hf(checkpoints, tmp_path, family, drop=(hf_name,)), hf_name, family)


@pytest.mark.parametrize(("family", "hf_name", "gguf_name"), MISSING, ids=[c[0] for c in MISSING])
def test_missing_tensor_is_refused_gguf(checkpoints, tmp_path, family, hf_name, gguf_name):
    tf.refused(_bad_gguf(checkpoints, tmp_path, family, _drop(gguf_name)), gguf_name, family)


# (family, the file's architecture, Hugging Face bias, GGUF bias, rows): a bias the config does not ask for
UNEXPECTED_BIASES = [
    ("qwen3", "qwen3", "model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias", 128),  # attention_bias false
    ("mistral", "llama", "model.layers.1.self_attn.v_proj.bias", "blk.1.attn_v.bias", 32),
    ("gemma2", "gemma2", "model.layers.0.self_attn.o_proj.bias", "blk.0.attn_output.bias", 64),
]


@pytest.mark.parametrize(
    ("family", "arch", "hf_name", "gguf_name", "rows"), UNEXPECTED_BIASES, ids=[c[0] for c in UNEXPECTED_BIASES]
)
def test_unexpected_bias_is_refused_hf(checkpoints, tmp_path, family, arch, hf_name, gguf_name, rows):
    tf.refused(_bad_hf(checkpoints, tmp_path, family, add={hf_name: np.ones(rows)}), hf_name, family)


@pytest.mark.parametrize(
    ("family", "arch", "hf_name", "gguf_name", "rows"), UNEXPECTED_BIASES, ids=[c[0] for c in UNEXPECTED_BIASES]
)
def test_unexpected_bias_is_refused_gguf(checkpoints, tmp_path, family, arch, hf_name, gguf_name, rows):
    tf.refused(_bad_gguf(checkpoints, tmp_path, family, _put(gguf_name, np.ones(rows))), gguf_name, arch)


# (family, Hugging Face tensor, GGUF tensor, stored shape, the shape the config implies)
WRONG_SHAPES = [
    # one k/v head's rows where num_key_value_heads is 2
    ("qwen2", "model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", (16, 64), (32, 64)),
    # Phi-3's fused q, k, v sized for 4 kv heads where the config says 2
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight", "blk.1.attn_qkv.weight", (192, 64), (128, 64)),
    # Qwen3's per-head norm sized dim / heads (16) where head_dim is 32
    ("qwen3", "model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight", (16,), (32,)),
]


@pytest.mark.parametrize(
    ("family", "hf_name", "gguf_name", "shape", "implied"), WRONG_SHAPES, ids=[c[0] for c in WRONG_SHAPES]
)
def test_wrong_shape_is_refused_hf(checkpoints, tmp_path, family, hf_name, gguf_name, shape, implied):
    bad = _bad_hf(checkpoints, tmp_path, family, add={hf_name: np.ones(shape)})
    tf.refused(bad, hf_name, str(shape), str(implied))


@pytest.mark.parametrize(
    ("family", "hf_name", "gguf_name", "shape", "implied"), WRONG_SHAPES, ids=[c[0] for c in WRONG_SHAPES]
)
def test_wrong_shape_is_refused_gguf(checkpoints, tmp_path, family, hf_name, gguf_name, shape, implied):
    bad = _bad_gguf(checkpoints, tmp_path, family, _put(gguf_name, np.ones(shape)))
    tf.refused(bad, gguf_name, str(shape), str(implied))
