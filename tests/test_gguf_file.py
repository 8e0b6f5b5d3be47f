"""GGUF reader on real files (SmolLM2, llama.cpp's vocab files) and on tiny written ones, checked against
gguf.GGUFReader as an independent parser."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from tiny_gguf import TENSOR_TYPES, find_smollm2_gguf, sizes_for, write_tiny_llama_gguf

from perfx_core.errors import ModelFormatError
from perfx_core.gguf_file import GGUFFile, read_gguf

VOCAB_DIR = Path(__file__).resolve().parent / "data" / "vocab"  # the repository tests itself
VOCAB_FILES = sorted(VOCAB_DIR.glob("*.gguf")) if VOCAB_DIR.is_dir() else []


@pytest.fixture(scope="module")
def smollm2_gguf() -> GGUFFile:
    return read_gguf(find_smollm2_gguf())


def reader_value(field: gguf.ReaderField):
    """A GGUFReader field's value in our conventions (numeric arrays as NumPy, string arrays as lists)."""
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
        return np.array([field.parts[i][0] for i in field.data], dtype=field.parts[field.data[0]].dtype)
    return field.contents()


def assert_same_metadata(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        field, mine = reader.fields[key], ours.metadata[key]
        theirs = reader_value(field)
        if isinstance(theirs, np.ndarray):
            assert isinstance(mine, np.ndarray), key
            assert mine.dtype == theirs.dtype.newbyteorder("="), key
            np.testing.assert_array_equal(mine, theirs, err_msg=key)
        else:
            assert type(mine) is type(theirs), key
            assert mine == theirs, key


def test_smollm2_metadata(smollm2_gguf: GGUFFile):
    m = smollm2_gguf.metadata
    assert smollm2_gguf.version == 3 and smollm2_gguf.alignment == 32
    assert m["general.architecture"] == "llama"
    assert m["llama.block_count"] == 30
    assert m["llama.embedding_length"] == 576
    assert m["llama.feed_forward_length"] == 1536
    assert m["llama.attention.head_count"] == 9 and m["llama.attention.head_count_kv"] == 3
    assert m["llama.rope.freq_base"] == 100000.0 and isinstance(m["llama.rope.freq_base"], float)
    assert m["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "smollm"
    tokens = m["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(m["tokenizer.ggml.merges"]) == 48900 and m["tokenizer.ggml.merges"][0] == "Ġ t"
    assert m["tokenizer.ggml.token_type"].dtype == np.int32 and len(m["tokenizer.ggml.token_type"]) == 49152
    assert m["tokenizer.ggml.add_bos_token"] is False
    assert m["general.languages"] == ["en"]


def test_smollm2_tensors(smollm2_gguf: GGUFFile):
    assert len(smollm2_gguf.tensors) == 272
    embd = smollm2_gguf.tensors["token_embd.weight"]
    assert embd.ggml_type == GGMLQuantizationType.Q8_0 and embd.shape == (49152, 576)
    assert embd.offset == smollm2_gguf.data_offset and embd.nbytes == 49152 * 576 // 32 * 34
    q = smollm2_gguf.tensors["blk.0.attn_q.weight"]
    assert q.ggml_type == GGMLQuantizationType.Q4_1 and q.shape == (576, 576)
    assert smollm2_gguf.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert smollm2_gguf.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)

    raw = smollm2_gguf.tensor_data("blk.0.attn_q.weight")
    assert isinstance(raw, np.memmap) and raw.dtype == np.uint8 and raw.shape == (576, 576 // 32 * 20)
    assert not raw.flags.writeable
    norm = smollm2_gguf.tensor_data("blk.0.attn_norm.weight")
    assert norm.dtype == np.float32 and norm.shape == (576,) and not norm.flags.writeable
    # Offsets agree with an independent parse of the tensor's bytes: the first Q4_1 block's d and m are sane.
    d, m = raw[0, :4].view(np.float16)
    assert np.isfinite([d, m]).all() and d > 0


def test_smollm2_parses_fast():
    path = find_smollm2_gguf()
    read_gguf(path)  # warm the page cache
    start = time.perf_counter()
    read_gguf(path)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("path", VOCAB_FILES, ids=[p.stem for p in VOCAB_FILES])
def test_vocab_file_matches_gguf_reader(path: Path):
    ours = read_gguf(path)
    assert ours.tensors == {}
    assert_same_metadata(ours, gguf.GGUFReader(path))


def test_vocab_files_present():
    assert VOCAB_FILES, f"no vocab files in {VOCAB_DIR}"
    spm = read_gguf(VOCAB_DIR / "ggml-vocab-llama-spm.gguf", tensors=False)
    assert spm.metadata["tokenizer.ggml.model"] == "llama" and len(spm.metadata["tokenizer.ggml.tokens"]) == 32000
    assert spm.metadata["tokenizer.ggml.scores"].dtype == np.float32
    bpe = read_gguf(VOCAB_DIR / "ggml-vocab-llama-bpe.gguf", tensors=False)
    assert bpe.metadata["tokenizer.ggml.pre"] == "llama-bpe" and len(bpe.metadata["tokenizer.ggml.tokens"]) == 128256


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_tiny_file_matches_gguf_reader(tmp_path: Path, tensor_type: str):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, tied=False, **sizes_for(tensor_type))
    ours = read_gguf(model.path)
    reader = gguf.GGUFReader(model.path)
    assert_same_metadata(ours, reader)
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        mine, theirs = ours.tensor_data(t.name), t.data
        np.testing.assert_array_equal(mine.reshape(-1).view(np.uint8), theirs.reshape(-1).view(np.uint8))


def test_metadata_only(tmp_path: Path):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf")
    gf = read_gguf(model.path, tensors=False)
    assert gf.tensors == {} and gf.data_offset is None
    assert gf.metadata["llama.block_count"] == 2
    with pytest.raises(ModelFormatError, match="tensors=False"):
        gf.tensor_data("token_embd.weight")
    with pytest.raises(ModelFormatError, match="no tensor 'nope'"):
        read_gguf(model.path).tensor_data("nope")


def test_custom_alignment(tmp_path: Path):
    model = write_tiny_llama_gguf(tmp_path / "m.gguf", alignment=64)
    gf = read_gguf(model.path)
    assert gf.alignment == 64 and gf.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in gf.tensors.values())
    np.testing.assert_array_equal(gf.tensor_data("output_norm.weight"), model.expected["output_norm.weight"])


def test_typed_tensor_views(tmp_path: Path):
    for tensor_type, dtype in (("F32", np.float32), ("F16", np.float16), ("BF16", np.uint16)):
        model = write_tiny_llama_gguf(tmp_path / f"{tensor_type}.gguf", tensor_type=tensor_type)
        raw = read_gguf(model.path).tensor_data("blk.0.attn_v.weight")
        assert raw.dtype == dtype and raw.shape == (model.n_kv_heads * model.head_dim, model.dim)


# -- every value type, built byte by byte ------------------------------------------------------------------


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def test_all_value_types(tmp_path: Path):
    V = GGUFValueType
    kvs = [
        ("u8", struct.pack("<IB", V.UINT8, 200), 200),
        ("i8", struct.pack("<Ib", V.INT8, -5), -5),
        ("u16", struct.pack("<IH", V.UINT16, 60000), 60000),
        ("i16", struct.pack("<Ih", V.INT16, -300), -300),
        ("u32", struct.pack("<II", V.UINT32, 4_000_000_000), 4_000_000_000),
        ("i32", struct.pack("<Ii", V.INT32, -7), -7),
        ("f32", struct.pack("<If", V.FLOAT32, 0.5), 0.5),
        ("bool", struct.pack("<IB", V.BOOL, 1), True),
        ("str", struct.pack("<I", V.STRING) + _str("héllo"), "héllo"),
        ("u64", struct.pack("<IQ", V.UINT64, 2**64 - 1), 2**64 - 1),
        ("i64", struct.pack("<Iq", V.INT64, -(2**40)), -(2**40)),
        ("f64", struct.pack("<Id", V.FLOAT64, 1e-300), 1e-300),
        ("empty", struct.pack("<IIQ", V.ARRAY, V.UINT8, 0), np.zeros(0, np.uint8)),
        ("bools", struct.pack("<IIQ3B", V.ARRAY, V.BOOL, 3, 1, 0, 1), np.array([True, False, True])),
        ("f64s", struct.pack("<IIQ2d", V.ARRAY, V.FLOAT64, 2, 1.5, -2.0), np.array([1.5, -2.0])),
        ("strs", struct.pack("<IIQ", V.ARRAY, V.STRING, 2) + _str("a") + _str(""), ["a", ""]),
        (
            "nested",
            struct.pack("<IIQ", V.ARRAY, V.ARRAY, 2)
            + struct.pack("<IQ2i", V.INT32, 2, 1, 2)
            + struct.pack("<IQ", V.STRING, 1)
            + _str("x"),
            [np.array([1, 2], np.int32), ["x"]],
        ),
    ]
    body = b"".join(_str(k) + v for k, v, _ in kvs)
    path = tmp_path / "types.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 2, 0, len(kvs)) + body)
    gf = read_gguf(path)
    assert gf.version == 2
    for key, _, want in kvs:
        got = gf.metadata[key]
        if key == "nested":
            np.testing.assert_array_equal(got[0], want[0])
            assert got[0].dtype == np.int32 and got[1] == want[1]
        elif isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, key
            np.testing.assert_array_equal(got, want)
        else:
            assert type(got) is type(want) and got == want, key
