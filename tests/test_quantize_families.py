"""`perfx quantize` and perfx's format for every family next to Llama: tiny random checkpoints of each
(tiny_families.build_hf_checkpoint) quantized with RTN and AWQ, loaded back and compared with transformers' own
float forward; the calibration forward and AWQ's scale folding checked against the float model, block by block."""

from __future__ import annotations

import dataclasses
import json
import shutil
from contextlib import contextmanager

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_families import FAMILIES, PHI3_LONGROPE, Checkpoints, edit_checkpoint, hf_logits, loaded, nmse
from tiny_gguf import write_tiny_llama_gguf

import perfx_core
from perfx_core.errors import ModelFormatError
from perfx_core.formats.hf import LINEARS, pick_group_size
from perfx_core.formats.perfx_format import (
    LLAMA_FIELDS,
    config_from_json,
    config_to_json,
    layer_vectors,
    load_perfx_directory,
)
from perfx_core.quant import quantize
from perfx_core.quant.awq import awq_block
from perfx_core.quant.forward import block_forward, rmsnorm, rope_tables
from perfx_core.quant.sources import open_source
from perfx_core.quant.support import IMPLEMENTED_FIELDS, check_quantizable
from perfx_core.weights import dequantize, quantize_rtn

NAMES = (*FAMILIES, "phi3-longrope")
VARIANTS = {"phi3-longrope": ("phi3", PHI3_LONGROPE)}
# 40 tokens: past Mistral's and Gemma's window of 8, and past the LongRoPE variant's original context (32), so
# transformers picks the long factors as perfx does at a context of 64.
IDS = list(range(3, 43))
CALIBRATION = dict(n_samples=4, seqlen=32)
# Logit NMSE against transformers' float forward, about 1.5x what int4 (RTN and AWQ, group 64/128) measures on
# these random models. Dropping one feature exceeds them: Qwen2's biases 0.88, Qwen3's q/k norms 0.27, Gemma 2's
# post-norms 0.089, Gemma 3's windows 0.41, Mistral's and Phi-3's windows 1.1 (measured on the RTN outputs).
BOUNDS = {"qwen2": 0.25, "qwen3": 0.09, "mistral": 0.32, "phi3": 0.27, "gemma2": 0.04, "gemma3": 0.06,
          "phi3-longrope": 0.55}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("families"), VARIANTS)


@pytest.fixture(scope="module")
def quantized(checkpoints):
    """quantized(name, method) -> (perfx directory, QuantizeReport), each made once."""
    made = {}

    def get(name: str, method: str):
        if (name, method) not in made:
            out = checkpoints.root / f"{name}-{method}"
            made[name, method] = out, quantize(checkpoints.hf(name), out, method=method, **CALIBRATION)
        return made[name, method]

    return get


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' float logits of IDS, per checkpoint."""
    from tiny_families import reference_model

    cache = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = hf_logits(reference_model(checkpoints.hf(name)), IDS)
        return cache[name]

    return get


# -- the calibration forward and the scale folding -------------------------------------------------------------


def _calibration_rows(source, ids):
    h = source.embedding_rows(np.asarray(ids))[None] * np.float32(source.config.embed_scale)
    return h.astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_calibration_forward_is_the_float_model(checkpoints, reference, name):
    """AWQ's block forward, run through every block and the output head, gives transformers' logits."""
    source = open_source(checkpoints.hf(name))
    c = source.config
    h = _calibration_rows(source, IDS)
    for i, (cos, sin) in enumerate(rope_tables(c, len(IDS))):
        h, _ = block_forward(h, source.layer(i), c, cos, sin, record=False, layer=i)
    # the output head in float32 (perfx's format keeps it as float16)
    head = load_file(str(checkpoints.hf(name) / "model.safetensors")).get("lm_head.weight")
    head = source.embedding_rows(np.arange(c.vocab_size)) if c.tied_embeddings else head
    logits = rmsnorm(h[0], source.norm(), c.norm_eps) @ head.T
    if c.final_softcap is not None:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    assert nmse(logits, reference(name)) < 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_awq_folding_keeps_every_float_block(checkpoints, name):
    """After AWQ's scales are folded (into the (1 + w) norms, v's rows and bias, up's rows) each float block
    computes what it did: the folds are exact in every family's layout."""
    source = open_source(checkpoints.hf(name))
    c = source.config
    h = np.concatenate([_calibration_rows(source, IDS[:32]), _calibration_rows(source, IDS[8:])])
    group_sizes = {n: 32 for n in LINEARS}
    changed = set()
    for i, (cos, sin) in enumerate(rope_tables(c, h.shape[1])):
        w = source.layer(i)
        out, inputs = block_forward(h, w, c, cos, sin, layer=i)
        folded = dict(w)
        awq_block(folded, inputs, c, group_sizes, np.arange(inputs.attn_in.shape[0]))
        after, _ = block_forward(h, folded, c, cos, sin, record=False, layer=i)
        assert nmse(after, out) < 1e-10, f"block {i}"
        changed |= {n for n in w if not np.array_equal(w[n], folded[n])}
        h = out
    # The searches chose scales (not all alpha = 0), so the folds were exercised, v's bias included.
    expected = {"attn_norm", "ffn_norm", "wv", "wo", "w_up", "w_down"} | ({"bv"} if c.qkv_bias else set())
    assert expected <= changed
    assert not changed & {"bq", "bk", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"}


# -- quantized models against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rtn", "awq"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_family_matches_transformers(quantized, reference, name, method):
    out, report = quantized(name, method)
    with loaded(out) as model:
        logits, n_layers = model.logits(IDS), model.config.n_layers
    error = nmse(logits, reference(name))
    print(f"{name} {method}: logit NMSE {error:.4f} against transformers' float forward")
    assert error < BOUNDS[name]
    if method == "awq":  # the searches include alpha = 0 (RTN): AWQ's output error is never above it
        assert len(report.errors) == n_layers
        for block in report.errors:
            assert set(block) == {"qkv", "o", "gate_up", "down"}
            assert all(awq <= rtn for rtn, awq in block.values())
        rtn_total, awq_total = np.sum([list(block.values()) for block in report.errors], axis=(0, 1))
        assert awq_total < rtn_total


@pytest.mark.parametrize("name", NAMES)
def test_rtn_output_is_the_loaders_rtn(checkpoints, quantized, name):
    """Everything but the linears is carried exactly: the perfx directory computes what the float checkpoint
    quantized on load does (only the embedding differs, float16 in perfx's format)."""
    out, _ = quantized(name, "rtn")
    with loaded(out) as model, loaded_rtn(checkpoints.hf(name)) as same:
        assert nmse(model.logits(IDS), same.logits(IDS)) < 1e-5


@contextmanager
def loaded_rtn(path):
    model = perfx_core.load(path, backend="numpy", context_length=64, quantize="rtn")
    try:
        yield model
    finally:
        model.close()


# -- the format: write -> load gives the same config and tensors -------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_perfx_directory_round_trips(checkpoints, quantized, name):
    out, report = quantized(name, "rtn")
    source = open_source(checkpoints.hf(name))
    config, weights, meta = load_perfx_directory(out)
    assert config == source.config and config_from_json(config_to_json(config), str(out)) == config
    assert meta["format_version"] == 2  # not a Llama model: a Llama-only reader must refuse it
    for i, layer in enumerate(weights.layers):
        w = source.layer(i)
        for n in layer_vectors(config):  # norms (Gemma's 1 added), biases, q/k norms, post-norms: exact
            np.testing.assert_array_equal(getattr(layer, n), w[n], err_msg=f"layer {i} {n}")
        for n in LINEARS:
            want = quantize_rtn(w[n], report.group_sizes[n])
            assert getattr(layer, n).group_size == pick_group_size(w[n].shape[1], 128)
            np.testing.assert_array_equal(dequantize(getattr(layer, n)), dequantize(want), err_msg=f"layer {i} {n}")
    np.testing.assert_array_equal(weights.norm, source.norm())
    np.testing.assert_array_equal(weights.token_embedding.data, source.embedding_f16())
    assert (weights.output is weights.token_embedding) == config.tied_embeddings


@pytest.mark.parametrize("name", FAMILIES)
def test_a_gguf_quantizes_as_its_checkpoint(checkpoints, quantized, name):
    """The GGUF source (llama.cpp's layout: permuted q/k rows, fused Phi-3 tensors, Gemma's 1 added) gives the
    same tensors as the Hugging Face one, bit for bit, from an F32 conversion."""
    gguf, _ = checkpoints.gguf(name, "F32")
    out = checkpoints.root / f"{name}-gguf-rtn"
    quantize(gguf, out, method="rtn")
    hf_tensors = load_file(str(quantized(name, "rtn")[0] / "model.safetensors"))
    gguf_tensors = load_file(str(out / "model.safetensors"))
    assert sorted(gguf_tensors) == sorted(hf_tensors)
    for key, value in hf_tensors.items():
        np.testing.assert_array_equal(gguf_tensors[key], value, err_msg=key)


def test_a_llama_directory_is_format_version_1_and_old_ones_load(tmp_path):
    tiny = write_tiny_llama_gguf(tmp_path / "t.gguf", tensor_type="F32", dim=64, ffn_dim=128)
    quantize(tiny.path, tmp_path / "new", method="rtn", group_size=32)
    meta = json.loads((tmp_path / "new" / "perfx.json").read_text())
    assert meta["format_version"] == 1
    # perfx.json as perfx wrote it before the families: only Llama's config fields
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    meta["config"] = {k: v for k, v in meta["config"].items() if k in LLAMA_FIELDS}
    (old / "perfx.json").write_text(json.dumps(meta))
    assert load_perfx_directory(old)[0] == load_perfx_directory(tmp_path / "new")[0]
    with loaded(old) as a, loaded(tmp_path / "new") as b:
        np.testing.assert_array_equal(a.logits([1, 2, 3, 4]), b.logits([1, 2, 3, 4]))


# -- what cannot be quantized or loaded right is refused -----------------------------------------------------------


def test_a_config_feature_the_quantizer_lacks_is_refused(checkpoints):
    config = open_source(checkpoints.hf("gemma2")).config
    check_quantizable(config)
    with pytest.raises(ModelFormatError, match="attn_softcap = 5.0; final_softcap = 3.0"):
        check_quantizable(config, IMPLEMENTED_FIELDS - {"attn_softcap", "final_softcap"})
    with pytest.raises(ModelFormatError, match="activation = 'relu'"):
        check_quantizable(dataclasses.replace(config, activation="relu"))


def test_a_tensor_the_family_does_not_use_is_refused(checkpoints, tmp_path):
    bias = np.zeros(64, np.float32)
    src = edit_checkpoint(checkpoints.hf("mistral"), tmp_path / "m", add={"model.layers.0.self_attn.o_proj.bias": bias})
    with pytest.raises(ModelFormatError, match="o_proj.bias"):
        quantize(src, tmp_path / "out", method="rtn")
    assert not (tmp_path / "out").exists()


def test_a_perfx_directory_whose_config_and_tensors_disagree_is_refused(quantized, tmp_path):
    out, _ = quantized("qwen2", "rtn")

    def with_config(name, **changes):
        d = shutil.copytree(out, tmp_path / name)
        meta = json.loads((d / "perfx.json").read_text())
        meta["config"].update(changes)
        (d / "perfx.json").write_text(json.dumps(meta))
        return d

    with pytest.raises(ModelFormatError, match="does not use: layers.0.bk, layers.0.bq"):
        load_perfx_directory(with_config("no-bias", qkv_bias=False))
    with pytest.raises(ModelFormatError, match="has no tensor 'layers.0.q_norm'"):
        load_perfx_directory(with_config("qk-norm", qk_norm=True))
    with pytest.raises(ModelFormatError, match="keys this perfx does not know \\('v_norm'\\)"):
        load_perfx_directory(with_config("unknown", v_norm=True))
