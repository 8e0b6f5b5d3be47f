"""load_llama_gguf: lossless conversion of every exact tensor type (Q8_0 and Q5_0 as the file's own codes and
scales), K-quant re-quantization, the q/k row un-permutation, tied/separate output, rope scaling, and SmolLM2 (a
real Q4_1 checkpoint with a Q8_0 embedding) end to end."""

from __future__ import annotations

import time
import tracemalloc
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_gguf import TENSOR_TYPES, find_smollm2_gguf, permute_hf_to_gguf, sizes_for, write_tiny_llama_gguf

from perfx_core.config import LlamaWeights, RopeScaling
from perfx_core.errors import ModelFormatError
from perfx_core.gguf_file import read_gguf
from perfx_core.gguf_loader import (
    check_tokenizer_metadata,
    hf_row_order,
    llama3_rope_divisors,
    load_llama_gguf,
    read_llama_config,
)
from perfx_core.split_weights import int5_codes
from perfx_core.weights import (
    DenseWeight,
    Int4Weight,
    Int5Weight,
    Int6Weight,
    Int8Weight,
    concat_rows,
    dequantize,
    for_runtime,
    take_rows,
)

LOSSLESS = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


def loaded_tensors(weights: LlamaWeights) -> dict[str, np.ndarray | object]:
    """Loaded weights keyed by GGUF tensor name."""
    out: dict[str, object] = {"token_embd.weight": weights.token_embedding, "output_norm.weight": weights.norm}
    for i, layer in enumerate(weights.layers):
        for gguf_name, field in LAYER_TENSORS.items():
            out[f"blk.{i}.{gguf_name}.weight"] = getattr(layer, field)
    if weights.output is not weights.token_embedding:
        out["output.weight"] = weights.output
    return out


def as_floats(w: object) -> np.ndarray:
    return w if isinstance(w, np.ndarray) else dequantize(w)  # type: ignore[arg-type]


# -- the q/k permutation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads,head_dim", [(1, 4), (4, 16), (9, 64), (3, 128)])
def test_hf_row_order_inverts_llama_cpp_permutation(n_heads: int, head_dim: int):
    rows = n_heads * head_dim
    w = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    order = hf_row_order(n_heads, head_dim)
    np.testing.assert_array_equal(permute_hf_to_gguf(w, n_heads)[order], w)  # round trip
    np.testing.assert_array_equal(order, np.argsort(permute_hf_to_gguf(np.arange(rows), n_heads)))
    # Spelled out for the first head: GGUF rows 0, 1, 2, 3 hold HF rows 0, hd/2, 1, hd/2 + 1 (interleaved halves).
    half = head_dim // 2
    assert list(permute_hf_to_gguf(np.arange(rows), n_heads)[:4]) == [0, half, 1, half + 1]


# -- tiny models of every tensor type -----------------------------------------------------------------------


@pytest.mark.parametrize("tensor_type", LOSSLESS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "separate"])
def test_lossless_types_load_exactly(tmp_path: Path, tensor_type: str, tied: bool):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=tied, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # lossless types must not warn
        config, weights, gf = load_llama_gguf(model.path)
    assert weights.notes == []

    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads) == (2, 64, 4, 2)
    assert (config.head_dim, config.ffn_dim, config.vocab_size) == (16, 128, model.vocab)
    assert config.rope_theta == 10000.0 and config.norm_eps == pytest.approx(1e-5)
    assert config.context_length == 256 and config.rope_scaling is None and config.name == "tiny-llama"
    assert config.tied_embeddings is tied
    assert (weights.output is weights.token_embedding) is tied

    got = loaded_tensors(weights)
    assert set(got) == set(model.expected)
    for name, want in model.expected.items():
        np.testing.assert_array_equal(as_floats(got[name]), want, err_msg=name)

    w = weights.layers[0].wq
    if tensor_type in ("Q4_0", "Q4_1"):
        assert isinstance(w, Int4Weight) and w.group_size == 32
    elif tensor_type == "Q8_0":
        assert isinstance(w, Int8Weight) and w.group_size == 32
    elif tensor_type in ("Q5_0", "Q5_1"):
        assert isinstance(w, Int5Weight)
    else:
        assert isinstance(w, DenseWeight)
        assert w.data.dtype == (np.float16 if tensor_type == "F16" else np.float32)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in (weights.norm, weights.layers[1].ffn_norm))


@pytest.mark.parametrize("tensor_type", [*LOSSLESS, "Q6_K"])
def test_matches_gguf_dequantize_of_stored_bytes(tmp_path: Path, tensor_type: str):
    """Independent of the writer's bookkeeping: compare with gguf.quants.dequantize of the file's own bytes."""
    path = tmp_path / "m.gguf"
    model = write_tiny_llama_gguf(path, tensor_type=tensor_type, tied=False, seed=1, **sizes_for(tensor_type))
    config, weights, gf = load_llama_gguf(model.path)
    for name, loaded in loaded_tensors(weights).items():
        info = gf.tensors[name]
        raw = np.asarray(gf.tensor_data(name))
        ref = gguf.quants.dequantize(raw.view(np.uint8) if info.ggml_type.name == "BF16" else raw, info.ggml_type)
        ref = ref.reshape(info.shape)
        if ".attn_q." in name or ".attn_k." in name:
            heads = config.n_heads if ".attn_q." in name else config.n_kv_heads
            ref = ref[np.argsort(permute_hf_to_gguf(np.arange(ref.shape[0]), heads))]
        np.testing.assert_array_equal(as_floats(loaded), ref, err_msg=name)


def _stored_blocks(gf, name: str, block_bytes: int, order: np.ndarray | None) -> np.ndarray:
    """The file's blocks of a tensor, (rows, blocks, block_bytes) uint8, rows in the loaded (HF) order."""
    raw = np.asarray(gf.tensor_data(name)).view(np.uint8)
    raw = raw if order is None else raw[order]
    return raw.reshape(raw.shape[0], -1, block_bytes)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "separate"])
def test_q8_0_loads_as_the_files_codes_and_scales(tmp_path: Path, tied: bool):
    """Q8_0 tensors written by the gguf library load as Int8Weight whose float16 scales and int8 codes are the
    blocks' own bytes; no float32 or float16 copy of the matrix is made."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q8_0", tied=tied, seed=5)
    config, weights, gf = load_llama_gguf(model.path)
    for name, w in loaded_tensors(weights).items():
        if isinstance(w, np.ndarray):
            continue  # the norm vectors
        assert isinstance(w, Int8Weight) and w.group_size == 32 and w.codes.dtype == np.int8, name
        blocks = _stored_blocks(gf, name, 34, _loaded_order(config, name, w.shape[0]))
        np.testing.assert_array_equal(w.scale.view(np.uint8).reshape(blocks.shape[:2] + (2,)), blocks[:, :, :2])
        np.testing.assert_array_equal(w.codes.view(np.uint8).reshape(blocks.shape[:2] + (32,)), blocks[:, :, 2:])
        np.testing.assert_array_equal(dequantize(w), model.expected[name], err_msg=name)
        assert w.nbytes == gf.tensors[name].nbytes  # the file's own bytes
    assert (weights.output is weights.token_embedding) is tied


def _loaded_order(config, name: str, rows: int) -> np.ndarray | None:
    """The file row of each loaded row (q and k rows are un-permuted on load), or None where they are the same."""
    heads = config.n_heads if ".attn_q." in name else config.n_kv_heads if ".attn_k." in name else 0
    return np.argsort(permute_hf_to_gguf(np.arange(rows), heads)) if heads else None


@pytest.mark.parametrize("tensor_type, block_bytes", [("Q5_0", 22), ("Q5_1", 24)])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "separate"])
def test_q5_types_load_as_the_files_nibbles_and_bits(tmp_path: Path, tensor_type: str, block_bytes: int, tied: bool):
    """Q5_0 and Q5_1 tensors load as Int5Weight holding each block's own bytes: its 16 nibble bytes, its 32
    fifth bits, d as the scale and m (Q5_1) or -16 d (Q5_0) as the bias, within a float16 per block of the file's
    size, and equal to the file's values."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=tied, seed=5)
    config, weights, gf = load_llama_gguf(model.path)
    for name, w in loaded_tensors(weights).items():
        if isinstance(w, np.ndarray):
            continue
        assert isinstance(w, Int5Weight), name
        blocks = _stored_blocks(gf, name, block_bytes, _loaded_order(config, name, w.shape[0]))
        lead = block_bytes - 20  # d (and m) before the fifth bits and the nibbles
        np.testing.assert_array_equal(w.low.reshape(blocks.shape[:2] + (16,)), blocks[:, :, lead + 4 :])
        np.testing.assert_array_equal(
            w.high.view(np.uint8).reshape(blocks.shape[:2] + (4,)), blocks[:, :, lead : lead + 4]
        )
        np.testing.assert_array_equal(w.scale.view(np.uint8).reshape(blocks.shape[:2] + (2,)), blocks[:, :, :2])
        if tensor_type == "Q5_1":
            np.testing.assert_array_equal(w.bias.view(np.uint8).reshape(blocks.shape[:2] + (2,)), blocks[:, :, 2:4])
        else:
            np.testing.assert_array_equal(w.bias, (w.scale.astype(np.float32) * -16).astype(np.float16))
        np.testing.assert_array_equal(dequantize(w), model.expected[name], err_msg=name)
        assert w.nbytes == gf.tensors[name].nbytes * 24 // block_bytes  # Q5_1: the file's own size
    assert (weights.output is weights.token_embedding) is tied


@pytest.mark.parametrize("tensor_type, taken, dtype", [("Q8_0", "int8", np.float32), ("Q5_0", "int5", np.float16)])
def test_quantized_weights_reach_other_runtimes_widened(tmp_path: Path, tensor_type: str, taken: str, dtype: type):
    """A runtime without int8 or int5 ops (OpenCL) gets what GGUF loaders always gave it: Q8_0 as exact float32,
    Q5_0 as float16 (the file's values rounded once), also for fused q|k|v weights of both types."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=2)
    _, weights, gf = load_llama_gguf(model.path)
    dense = for_runtime(weights.token_embedding, frozenset(), frozenset())
    assert isinstance(dense, DenseWeight) and dense.data.dtype == dtype
    raw = np.asarray(gf.tensor_data("token_embd.weight"))
    ref = gguf.quants.dequantize(raw, gf.tensors["token_embd.weight"].ggml_type).reshape(dense.shape)
    np.testing.assert_array_equal(dense.data, ref.astype(dtype))
    assert for_runtime(weights.token_embedding, frozenset(), frozenset({taken})) is weights.token_embedding
    layer = weights.layers[0]
    fused = for_runtime(concat_rows([layer.wq, layer.wk, layer.wv]), frozenset(), frozenset())
    assert isinstance(fused, DenseWeight) and fused.data.dtype == dtype
    as_int8 = for_runtime(concat_rows([layer.wq, layer.wk, layer.wv]), frozenset(), frozenset({"int8"}))
    assert isinstance(as_int8, Int8Weight)  # Q5_0 where int5 is not taken: its codes - 16, exactly
    np.testing.assert_array_equal(
        dequantize(as_int8), np.concatenate([dequantize(w) for w in (layer.wq, layer.wk, layer.wv)])
    )


def test_q5_1_reaches_an_int8_runtime_as_float16(tmp_path: Path):
    """Q5_1's biases are not -16 times its scales, so int8 cannot hold it: float16 (the file's values rounded once)."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q5_1", seed=4)
    _, weights, _ = load_llama_gguf(model.path)
    wide = for_runtime(weights.layers[0].wq, frozenset(), frozenset({"int8"}))
    assert isinstance(wide, DenseWeight) and wide.data.dtype == np.float16
    np.testing.assert_array_equal(wide.data, dequantize(weights.layers[0].wq).astype(np.float16))


def test_row_parts_fuse_again_where_int5_becomes_int8(tmp_path: Path):
    """Gemma 3's Q4_K_M mix: a Q5_0 q|k next to a Q8_0 v stays two parts (int5, int8) where int5 is taken, and is
    one int8 matrix again on a runtime that takes int8 only (one matmul, not two)."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q5_0", seed=4)
    _, weights, _ = load_llama_gguf(model.path)
    layer = weights.layers[0]
    rows, cols = layer.wv.shape
    v8 = Int8Weight(np.ones((rows, cols), np.int8), np.full((rows, cols // 32), 0.5, np.float16))
    parts = concat_rows([layer.wq, layer.wk, v8])
    assert [type(p) for p in parts.parts] == [Int5Weight, Int8Weight]
    assert for_runtime(parts, frozenset(), frozenset({"int8", "int5"})) == parts
    fused = for_runtime(parts, frozenset(), frozenset({"int8"}))
    assert isinstance(fused, Int8Weight)
    np.testing.assert_array_equal(dequantize(fused), dequantize(parts))


def test_q5_k_keeps_its_codes(tmp_path: Path):
    """Q5_K's codes as stored: element 64c + 32h + i of a super-block is nibble h of byte 32c + i plus 16 times
    bit 2c + h of fifth-bit byte i; within 10% of the file's bytes."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q5_K", tied=False, **sizes_for("Q5_K"))
    _, weights, gf = load_llama_gguf(model.path)
    blocks = _stored_blocks(gf, "blk.0.ffn_up.weight", 176, None)
    qs, qh = blocks[:, :, 48:].reshape(*blocks.shape[:2], 4, 1, 32), blocks[:, :, None, 16:48]
    want = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(*blocks.shape[:2], 8, 32)
    want |= ((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4
    w = loaded_tensors(weights)["blk.0.ffn_up.weight"]
    np.testing.assert_array_equal(int5_codes(w.low, w.high), want.reshape(w.shape))
    assert w.nbytes <= gf.tensors["blk.0.ffn_up.weight"].nbytes * 1.1


@pytest.mark.parametrize("tensor_type, kind", [("Q4_K", Int4Weight), ("Q5_K", Int5Weight)])
def test_k_quants_load_with_their_own_codes(tmp_path: Path, tensor_type: str, kind: type):
    """Q4_K and Q5_K are 4- and 5-bit codes with a scale and a minimum per 32 values: they load as Int4Weight and
    Int5Weight, without a warning, and differ from the file's values (gguf's dequantization, rows un-permuted) only
    by the float16 rounding of each group's scale (and Q5_K's minimum)."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=False, **sizes_for(tensor_type))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, weights, _ = load_llama_gguf(model.path)
    assert weights.notes == []
    got = loaded_tensors(weights)
    for name, want in model.expected.items():
        w = got[name]
        if want.ndim == 1:
            np.testing.assert_array_equal(w, want)
            continue
        assert isinstance(w, kind) and w.group_size == 32, name
        nmse = float(((dequantize(w) - want) ** 2).mean() / (want**2).mean())
        assert nmse < 1e-6, (name, nmse)
        if kind is Int4Weight:  # Q4_K's own factors ride along and give the file's values exactly
            f = w.k_scales
            scale = np.repeat(f.d.astype(np.float64), 8, axis=1) * f.sc
            bias = -np.repeat(f.dmin.astype(np.float64), 8, axis=1) * f.m
            codes = np.stack((w.packed & 15, w.packed >> 4), axis=-1).reshape(*scale.shape, 32)
            exact = codes * scale[..., None] + bias[..., None]
            np.testing.assert_array_equal(exact.reshape(want.shape), want, err_msg=name)
            np.testing.assert_array_equal(f.scale_bias()[1], w.bias)
            assert w.nbytes - f.nbytes == w.packed.nbytes + w.scale.nbytes + w.bias.nbytes
            both = concat_rows([w, take_rows(w, np.arange(w.shape[0])[::-1])])
            np.testing.assert_array_equal(both.k_scales.sc[: w.shape[0]], f.sc)
            np.testing.assert_array_equal(both.k_scales.d[w.shape[0] :], f.d[::-1])


@pytest.mark.parametrize(
    "tensor_type, form", [("Q5_0", Int8Weight), ("Q5_1", DenseWeight), ("Q6_K", Int8Weight)], ids=str
)
def test_a_runtime_without_split_formats_gets_what_it_takes_in_one_pass(tmp_path: Path, tensor_type: str, form):
    """Loading for a runtime that takes int8 but not int5 / int6 (OpenCL) converts Q5_0 and Q6_K straight to int8
    and Q5_1 to float16 (with the widening note), the same values for_runtime gives from the int5 / int6 forms."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=False, **sizes_for(tensor_type))
    _, split, _ = load_llama_gguf(model.path)
    with warnings.catch_warnings(record=True):
        _, direct, _ = load_llama_gguf(model.path, weight_formats=frozenset({"int8"}))
    assert bool(direct.notes) == (form is DenseWeight)
    for name, w in loaded_tensors(direct).items():
        if isinstance(w, np.ndarray):
            continue
        assert isinstance(w, form), name
        converted = for_runtime(loaded_tensors(split)[name], frozenset(), frozenset({"int8"}))
        np.testing.assert_array_equal(dequantize(w), dequantize(converted), err_msg=name)


def test_q6_k_loads_exactly_as_int6(tmp_path: Path):
    """Q6_K is codes 0..63 times d * sub-scale, centred: it loads as an Int6Weight holding its codes, int8 sub-scales
    and float16 d as stored, in the file's bytes, without a warning, equal to the file's values (un-permuted rows
    included); a runtime without int6 gets the same values exactly as an Int8Weight with float32 scales per 16."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q6_K", tied=False, **sizes_for("Q6_K"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, weights, gf = load_llama_gguf(model.path)
    assert weights.notes == []
    for name, w in loaded_tensors(weights).items():
        if isinstance(w, np.ndarray):
            continue  # the norm vectors
        assert isinstance(w, Int6Weight), name
        assert w.nbytes == gf.tensors[name].nbytes, name  # 210 bytes per 256 values, as the file
        np.testing.assert_array_equal(dequantize(w), model.expected[name], err_msg=name)
        as_int8 = for_runtime(w, frozenset(), frozenset({"int8"}))
        assert isinstance(as_int8, Int8Weight) and as_int8.group_size == 16 and as_int8.scale.dtype == np.float32
        np.testing.assert_array_equal(dequantize(as_int8), model.expected[name], err_msg=name)
    blocks = _stored_blocks(gf, "blk.0.ffn_up.weight", 210, None)
    w = loaded_tensors(weights)["blk.0.ffn_up.weight"]
    np.testing.assert_array_equal(w.sub.view(np.uint8).reshape(blocks.shape[:2] + (16,)), blocks[:, :, 192:208])
    np.testing.assert_array_equal(w.d.view(np.uint8).reshape(blocks.shape[:2] + (2,)), blocks[:, :, 208:])


def test_q4_k_unpermutes_q_and_k(tmp_path: Path):
    """A wrong row order would give errors of the weights' size, far beyond one quantization step."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q4_K", **sizes_for("Q4_K"))
    _, weights, _ = load_llama_gguf(model.path)
    for name, w in (("blk.0.attn_q.weight", weights.layers[0].wq), ("blk.1.attn_k.weight", weights.layers[1].wk)):
        want = model.expected[name]
        assert np.corrcoef(dequantize(w).ravel(), want.ravel())[0, 1] > 0.99


def test_unpermuted_rows_differ_from_file_order(tmp_path: Path):
    """Guards the test above against a no-op: the stored q rows really are in a different order."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf")
    stored = np.asarray(read_gguf(model.path).tensor_data("blk.0.attn_q.weight"))
    assert not np.array_equal(stored, model.expected["blk.0.attn_q.weight"])


def test_accepts_parsed_file_and_rejects_metadata_only(tmp_path: Path):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf")
    gf = read_gguf(model.path)
    config, _, same = load_llama_gguf(gf)
    assert same is gf and config == read_llama_config(gf)
    with pytest.raises(ModelFormatError, match="tensors=False"):
        load_llama_gguf(read_gguf(model.path, tensors=False))


def test_tokenizer_metadata_of_tiny_model(tmp_path: Path):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf")
    meta = read_gguf(model.path, tensors=False).metadata
    check_tokenizer_metadata(meta)
    assert meta["tokenizer.ggml.tokens"] == model.tokens and meta["tokenizer.ggml.merges"] == model.merges
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.eos_token_id"] == 2


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q5_0"])
def test_load_memory_is_bounded(tmp_path: Path, tensor_type: str):
    """Peak memory stays near what is returned: conversions go chunk by chunk, not via full-size temporaries."""
    model = write_tiny_llama_gguf(
        tmp_path / "m.gguf", tensor_type=tensor_type, dim=256, n_heads=4, vocab=8192, n_layers=1
    )
    tracemalloc.start()
    try:
        _, weights, _ = load_llama_gguf(model.path)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = weights.token_embedding.nbytes  # 4 or 8 MiB
    assert peak - current < largest, f"peak {peak >> 20} MiB, returned {current >> 20} MiB"


# -- rope scaling -------------------------------------------------------------------------------------------

LLAMA3_KEYS = {
    "llama.rope.scaling.type": "llama3",
    "llama.rope.scaling.factor": 8.0,
    "llama.rope.scaling.original_context_length": 64,
}


def test_llama3_rope_scaling_keys(tmp_path: Path):
    keys = {**LLAMA3_KEYS, "llama.rope.scaling.high_freq_factor": 2.0}
    config, weights, _ = load_llama_gguf(write_tiny_llama_gguf(tmp_path / "m.gguf", overrides=keys).path)
    assert config.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0, original_context_length=64
    )
    assert weights.notes == []


def test_rope_freqs_with_matching_keys(tmp_path: Path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", overrides=LLAMA3_KEYS, rope_freqs=(8.0, 1.0, 4.0, 64)).path
    config, weights, gf = load_llama_gguf(path)
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert any("rope_freqs.weight" in n for n in weights.notes)
    stored = np.asarray(gf.tensor_data("rope_freqs.weight"))
    assert len(set(stored.round(4))) > 2  # the tiny setup exercises the smooth middle band, not only 1 and 8
    np.testing.assert_allclose(llama3_rope_divisors(config.rope_scaling, 16, 10000.0), stored, rtol=1e-6)


def test_rope_freqs_disagreeing_with_keys(tmp_path: Path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", overrides=LLAMA3_KEYS, rope_freqs=(4.0, 1.0, 4.0, 64)).path
    with pytest.raises(ModelFormatError, match="rope_freqs.weight disagrees"):
        load_llama_gguf(path)


def test_rope_freqs_alone_gives_the_same_rotation_as_the_keys(tmp_path: Path):
    """llama.cpp's Llama-3.1 GGUFs carry only rope_freqs.weight; its divisors must rotate like the keys do."""
    from perfx_core.rope import rope_cos_sin

    alone, _, _ = load_llama_gguf(write_tiny_llama_gguf(tmp_path / "a.gguf", rope_freqs=(8.0, 1.0, 4.0, 64)).path)
    keyed, _, _ = load_llama_gguf(write_tiny_llama_gguf(tmp_path / "k.gguf", overrides=LLAMA3_KEYS).path)
    assert alone.rope_scaling is None and alone.rope_freq_divisors is not None
    cos_a, sin_a = rope_cos_sin(alone, 256)
    cos_k, sin_k = rope_cos_sin(keyed, 256)
    np.testing.assert_allclose(cos_a, cos_k, atol=2e-4)
    np.testing.assert_allclose(sin_a, sin_k, atol=2e-4)


# -- SmolLM2 ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_loaded():
    path = find_smollm2_gguf()
    start = time.perf_counter()
    loaded = load_llama_gguf(path)
    return loaded, time.perf_counter() - start


def test_smollm2_config(smollm2_loaded):
    (config, weights, gf), seconds = smollm2_loaded
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.ffn_dim, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.context_length == 8192 and config.rope_scaling is None
    assert config.tied_embeddings and weights.output is weights.token_embedding
    assert len(weights.layers) == 30 and weights.notes == []
    assert seconds < 10


def test_smollm2_tensors_exact(smollm2_loaded):
    (config, weights, gf), _ = smollm2_loaded

    def reference(name: str, n_heads: int = 0) -> np.ndarray:
        info = gf.tensors[name]
        ref = gguf.quants.dequantize(np.asarray(gf.tensor_data(name)), info.ggml_type).reshape(info.shape)
        return ref[np.argsort(permute_hf_to_gguf(np.arange(ref.shape[0]), n_heads))] if n_heads else ref

    layer = weights.layers[7]
    assert isinstance(layer.wq, Int4Weight) and layer.wq.group_size == 32
    np.testing.assert_array_equal(dequantize(layer.wq), reference("blk.7.attn_q.weight", config.n_heads))
    np.testing.assert_array_equal(dequantize(layer.wk), reference("blk.7.attn_k.weight", config.n_kv_heads))
    np.testing.assert_array_equal(dequantize(layer.w_down), reference("blk.7.ffn_down.weight"))
    np.testing.assert_array_equal(layer.attn_norm, reference("blk.7.attn_norm.weight"))
    # The Q8_0 embedding (and tied LM head): the file's int8 codes and float16 scales, 34 bytes per 32 weights.
    embedding = weights.token_embedding
    assert isinstance(embedding, Int8Weight) and embedding.nbytes == gf.tensors["token_embd.weight"].nbytes
    blocks = _stored_blocks(gf, "token_embd.weight", 34, None)
    np.testing.assert_array_equal(embedding.codes.view(np.uint8).reshape(49152, 18, 32), blocks[:, :, 2:])
    np.testing.assert_array_equal(embedding.scale.view(np.uint8).reshape(49152, 18, 2), blocks[:, :, :2])
    np.testing.assert_array_equal(dequantize(embedding)[:4096], reference("token_embd.weight")[:4096])


def test_smollm2_tokenizer_metadata(smollm2_loaded):
    (_, _, gf), _ = smollm2_loaded
    check_tokenizer_metadata(gf.metadata)


def test_all_tensor_types_covered():
    assert set(LOSSLESS) | {"Q4_K", "Q5_K", "Q6_K"} == set(TENSOR_TYPES)
