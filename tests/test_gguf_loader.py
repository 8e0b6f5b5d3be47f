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
from perfx_core.weights import DenseWeight, Int4Weight, Int8Weight, concat_rows, dequantize, for_runtime

LOSSLESS = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_1")
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
    elif tensor_type in ("Q8_0", "Q5_0"):
        assert isinstance(w, Int8Weight) and w.group_size == 32
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


@pytest.mark.parametrize("tensor_type, block_bytes", [("Q8_0", 34), ("Q5_0", 22)])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "separate"])
def test_int8_types_load_as_the_files_codes_and_scales(tmp_path: Path, tensor_type: str, block_bytes: int, tied: bool):
    """Q8_0 and Q5_0 tensors written by the gguf library load as Int8Weight whose float16 scales are the blocks'
    own two bytes and whose codes are Q8_0's bytes (Q5_0: its 5-bit codes, so that codes * scale is the file's
    value); no float32 or float16 copy of the matrix is made."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=tied, seed=5)
    config, weights, gf = load_llama_gguf(model.path)
    orders = {".attn_q.": config.n_heads, ".attn_k.": config.n_kv_heads}
    for name, w in loaded_tensors(weights).items():
        if isinstance(w, np.ndarray):
            continue  # the norm vectors
        assert isinstance(w, Int8Weight) and w.group_size == 32 and w.codes.dtype == np.int8, name
        heads = next((h for part, h in orders.items() if part in name), 0)
        order = np.argsort(permute_hf_to_gguf(np.arange(w.shape[0]), heads)) if heads else None
        blocks = _stored_blocks(gf, name, block_bytes, order)
        np.testing.assert_array_equal(w.scale.view(np.uint8).reshape(blocks.shape[:2] + (2,)), blocks[:, :, :2])
        if tensor_type == "Q8_0":
            np.testing.assert_array_equal(w.codes.view(np.uint8).reshape(blocks.shape[:2] + (32,)), blocks[:, :, 2:])
        else:
            assert -16 <= w.codes.min() and w.codes.max() <= 15
        np.testing.assert_array_equal(dequantize(w), model.expected[name], err_msg=name)
        assert w.nbytes == gf.tensors[name].nbytes * 34 // block_bytes  # Q8_0: the file's own bytes
    assert (weights.output is weights.token_embedding) is tied


@pytest.mark.parametrize("tensor_type, dtype", [("Q8_0", np.float32), ("Q5_0", np.float16)])
def test_int8_weights_reach_other_runtimes_widened(tmp_path: Path, tensor_type: str, dtype: type):
    """A runtime without int8 ops (OpenCL) gets what GGUF loaders always gave it: Q8_0 as exact float32, Q5_0 as
    float16 (the file's values rounded once), also for fused q|k|v weights of both types."""
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=2)
    _, weights, gf = load_llama_gguf(model.path)
    dense = for_runtime(weights.token_embedding, frozenset(), frozenset())
    assert isinstance(dense, DenseWeight) and dense.data.dtype == dtype
    raw = np.asarray(gf.tensor_data("token_embd.weight"))
    ref = gguf.quants.dequantize(raw, gf.tensors["token_embd.weight"].ggml_type).reshape(dense.shape)
    np.testing.assert_array_equal(dense.data, ref.astype(dtype))
    assert for_runtime(weights.token_embedding, frozenset(), frozenset({"int8"})) is weights.token_embedding
    layer = weights.layers[0]
    fused = for_runtime(concat_rows([layer.wq, layer.wk, layer.wv]), frozenset(), frozenset())
    assert isinstance(fused, DenseWeight) and fused.data.dtype == dtype
    mixed = concat_rows([layer.wq, DenseWeight(dense.data[:3])])  # int8 next to dense: dense in the int8's dtype
    assert isinstance(mixed, DenseWeight) and mixed.data.dtype == dtype


def test_q4_k_loads_as_int4_with_its_own_codes(tmp_path: Path):
    """Q4_K is int4 with a scale and a minimum per 32 values: it loads as such, without a warning, and differs
    from the file's values only by the float16 rounding of each group's scale."""
    import warnings

    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q4_K", tied=False, **sizes_for("Q4_K"))
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
        assert isinstance(w, Int4Weight) and w.group_size == 32, name
        nmse = float(((dequantize(w) - want) ** 2).mean() / (want**2).mean())
        assert nmse < 1e-6, (name, nmse)


def test_q6_k_loads_exactly_as_int8_group_16(tmp_path: Path):
    """Q6_K is int8 codes -32..31 per 16 values times d * sub-scale: it loads as an Int8Weight with those codes
    and float32 scales, without a warning, and equal to the file's values (un-permuted rows included)."""
    import warnings

    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q6_K", tied=False, **sizes_for("Q6_K"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, weights, _ = load_llama_gguf(model.path)
    assert weights.notes == []
    for name, w in loaded_tensors(weights).items():
        if isinstance(w, np.ndarray):
            continue  # the norm vectors
        assert isinstance(w, Int8Weight) and w.group_size == 16 and w.scale.dtype == np.float32, name
        assert w.codes.min() >= -32 and w.codes.max() <= 31, name
        assert w.nbytes == w.codes.size * 1.25, name  # one byte per code, four per 16 codes' scale
        np.testing.assert_array_equal(dequantize(w), model.expected[name], err_msg=name)


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
    assert set(LOSSLESS) | {"Q4_K", "Q6_K"} == set(TENSOR_TYPES)
