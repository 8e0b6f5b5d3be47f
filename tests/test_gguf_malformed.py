"""A corpus of malformed GGUF files, made from a valid tiny model by byte surgery (or by writing one without a
key). Every case must fail as a typed error that names the problem, in under a second, with bounded memory."""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType
from tiny_gguf import DELETE, tiny_vocab, write_tiny_llama_gguf

from perfx_core.errors import ModelFormatError, ModelNotFoundError
from perfx_core.gguf_file import read_gguf
from perfx_core.gguf_loader import check_tokenizer_metadata, load_llama_gguf

MAX_SECONDS = 1.0
MAX_PEAK_BYTES = 64 << 20


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("base")
    return {t: write_tiny_llama_gguf(d / f"{t}.gguf", tensor_type=t).path.read_bytes() for t in ("F32", "Q8_0")}


# -- byte surgery helpers (independent of perfx's parser: they search for the encoded key or tensor name) ----


def after_string(b: bytearray, s: str, start: int = 0) -> int:
    """Offset just past the one GGUF string (u64 length + bytes) equal to ``s``."""
    needle = struct.pack("<Q", len(s.encode())) + s.encode()
    pos = b.find(needle, start)
    assert pos >= 0 and b.find(needle, pos + 1) < 0, s
    return pos + len(needle)


def string_start(b: bytearray, s: str) -> int:
    return after_string(b, s) - len(s.encode())


def put_u32(b: bytearray, pos: int, v: int) -> None:
    b[pos : pos + 4] = struct.pack("<I", v)


def put_u64(b: bytearray, pos: int, v: int) -> None:
    b[pos : pos + 8] = struct.pack("<Q", v)


def tensor_fields(b: bytearray, name: str) -> dict[str, int]:
    """Offsets of a tensor info's n_dims, dims, type and offset fields (dims as stored: ne0 first)."""
    pos = after_string(b, name)
    (n_dims,) = struct.unpack_from("<I", b, pos)
    return {"n_dims": pos, "dims": pos + 4, "type": pos + 4 + 8 * n_dims, "offset": pos + 8 + 8 * n_dims}


# -- the corpus ---------------------------------------------------------------------------------------------

Surgery = Callable[[bytearray], "bytes | bytearray"]


def edit(fn: Callable[[bytearray], None], base_type: str = "F32") -> tuple[str, Surgery]:
    def apply(b: bytearray) -> bytearray:
        fn(b)
        return b

    return base_type, apply


def cut(at: Callable[[bytearray], int]) -> tuple[str, Surgery]:
    return "F32", lambda b: b[: at(b)]


def deep_nesting(_: bytearray) -> bytes:
    kv = struct.pack("<Q", 1) + b"x" + struct.pack("<I", GGUFValueType.ARRAY)
    kv += struct.pack("<IQ", GGUFValueType.ARRAY, 1) * 1000 + struct.pack("<IQ", GGUFValueType.UINT8, 0)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv


TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPE = "tokenizer.ggml.token_type"
BIG = 1 << 40

# id -> ((base tensor type, surgery), expected message regex); the file is read with read_gguf.
BYTE_CASES: dict[str, tuple[tuple[str, Surgery], str]] = {
    "empty-file": (("F32", lambda b: b""), "too small"),
    "truncated-header": (cut(lambda b: 20), "too small"),
    "bad-magic": (edit(lambda b: b.__setitem__(slice(0, 4), b"GGML")), "not a GGUF file"),
    "version-1": (edit(lambda b: put_u32(b, 4, 1)), "version 1"),
    "version-99": (edit(lambda b: put_u32(b, 4, 99)), "version 99"),
    "big-endian": (edit(lambda b: b.__setitem__(slice(4, 8), struct.pack(">I", 3))), "big-endian"),
    "tensor-count-2^62": (edit(lambda b: put_u64(b, 8, 1 << 62)), "tensor count 4611686018427387904"),
    "kv-count-2^62": (edit(lambda b: put_u64(b, 16, 1 << 62)), "key count 4611686018427387904"),
    "key-length-past-eof": (edit(lambda b: put_u64(b, 24, 1 << 60)), "key of metadata entry 0 claims"),
    "string-value-past-eof": (
        edit(lambda b: put_u64(b, after_string(b, "general.architecture") + 4, BIG)),
        "string value of 'general.architecture' claims",
    ),
    "uint8-array-2^40": (
        edit(lambda b: _array_header(b, TOKEN_TYPE, GGUFValueType.UINT8, BIG)),
        f"array '{TOKEN_TYPE}' claims {BIG} UINT8 elements",
    ),
    "string-array-2^40": (
        edit(lambda b: put_u64(b, after_string(b, TOKENS) + 8, BIG)),
        f"array '{TOKENS}' claims {BIG} STRING elements",
    ),
    "string-in-array-past-eof": (
        edit(lambda b: put_u64(b, after_string(b, TOKENS) + 16, BIG)),
        f"string 0 of array '{TOKENS}' claims",
    ),
    "invalid-utf8-key": (
        edit(lambda b: b.__setitem__(string_start(b, "llama.block_count"), 0xFF)),
        "key of metadata entry .* is not valid UTF-8",
    ),
    "invalid-utf8-in-string-array": (
        edit(lambda b: b.__setitem__(string_start(b, "<|endoftext|>"), 0xC3)),
        f"string 0 of array '{TOKENS}' is not valid UTF-8",
    ),
    "unknown-value-type": (
        edit(lambda b: put_u32(b, after_string(b, "llama.block_count"), 99)),
        "'llama.block_count' has unknown value type 99",
    ),
    "unknown-array-element-type": (
        edit(lambda b: put_u32(b, after_string(b, TOKENS) + 4, 13)),
        f"elements of array '{TOKENS}' has unknown value type 13",
    ),
    "bool-not-0-or-1": (
        edit(lambda b: b.__setitem__(after_string(b, "tokenizer.ggml.add_bos_token") + 4, 2)),
        "BOOL value of 'tokenizer.ggml.add_bos_token' is 2",
    ),
    "duplicate-key": (
        edit(lambda b: b.__setitem__(slice(*_span(b, "tokenizer.ggml.bos_token_id", "bos")), b"eos")),
        "'tokenizer.ggml.eos_token_id' appears twice",
    ),
    "deep-nesting": (("F32", deep_nesting), "nested more than 8 levels"),
    "truncated-in-metadata": (
        cut(lambda b: after_string(b, "tokenizer.ggml.merges") + 16 + 250),
        "string .* of array 'tokenizer.ggml.merges' (claims|is truncated)",
    ),
    "truncated-in-metadata-counts": (cut(lambda b: after_string(b, TOKENS) + 200), "tensor count 20 is impossible"),
    "truncated-in-tensor-infos": (
        cut(lambda b: after_string(b, "token_embd.weight") + 6),
        "dimensions of tensor 'token_embd.weight' needs 16 bytes but only 2 remain",
    ),
    "truncated-after-tensor-infos": (
        cut(lambda b: after_string(b, "blk.1.attn_q.weight")),
        "'token_embd.weight' .* needs 73728 bytes, more than the whole file",
    ),
    "truncated-in-tensor-data": (cut(lambda b: len(b) - 100), "but the file ends at"),
    "tensor-offset-past-eof": (
        edit(lambda b: put_u64(b, tensor_fields(b, "output_norm.weight")["offset"], BIG)),
        "tensor 'output_norm.weight' occupies .* but the file ends",
    ),
    "tensor-offset-misaligned": (
        edit(lambda b: _add_u64(b, tensor_fields(b, "blk.0.attn_q.weight")["offset"], 4)),
        "'blk.0.attn_q.weight' has data offset .* not a multiple of the alignment 32",
    ),
    "tensors-overlap": (
        edit(lambda b: put_u64(b, tensor_fields(b, "blk.0.attn_k.weight")["offset"], 0)),
        "overlap",
    ),
    "unknown-tensor-type-99": (
        edit(lambda b: put_u32(b, tensor_fields(b, "blk.0.attn_q.weight")["type"], 99)),
        "'blk.0.attn_q.weight' has unknown ggml type 99",
    ),
    "n-dims-9": (
        edit(lambda b: put_u32(b, tensor_fields(b, "blk.0.attn_q.weight")["n_dims"], 9)),
        "'blk.0.attn_q.weight' has 9 dimensions",
    ),
    "dims-overflow-2^64": (
        edit(lambda b: b.__setitem__(slice(*_dims(b, "token_embd.weight")), struct.pack("<QQ", 1 << 40, 1 << 40))),
        "'token_embd.weight' with dimensions .* needs .* bytes, more than the whole file",
    ),
    "dim-zero": (
        edit(lambda b: put_u64(b, tensor_fields(b, "blk.0.ffn_up.weight")["dims"] + 8, 0)),
        "'blk.0.ffn_up.weight' has dimension 0",
    ),
    "rows-not-multiple-of-block": (
        edit(lambda b: put_u64(b, tensor_fields(b, "blk.0.ffn_up.weight")["dims"], 48), "Q8_0"),
        "rows of 48 elements, not a multiple of its block size 32",
    ),
    "duplicate-tensor-name": (
        edit(lambda b: b.__setitem__(slice(*_span(b, "blk.1.attn_k.weight", "_k")), b"_q")),
        "tensor name 'blk.1.attn_q.weight' appears twice",
    ),
}


def _span(b: bytearray, s: str, part: str) -> tuple[int, int]:
    start = string_start(b, s) + s.index(part)
    return start, start + len(part)


def _dims(b: bytearray, name: str) -> tuple[int, int]:
    f = tensor_fields(b, name)
    return f["dims"], f["type"]


def _array_header(b: bytearray, key: str, element_type: int, count: int) -> None:
    pos = after_string(b, key) + 4  # past the value type ARRAY
    put_u32(b, pos, element_type)
    put_u64(b, pos + 4, count)


def _add_u64(b: bytearray, pos: int, delta: int) -> None:
    (v,) = struct.unpack_from("<Q", b, pos)
    put_u64(b, pos, v + delta)


# id -> (write_tiny_llama_gguf keyword arguments, expected message regex, what must fail:
#        "read" = read_gguf, "load" = load_llama_gguf, "tokenizer" = check_tokenizer_metadata only)
WRITTEN_CASES: dict[str, tuple[dict, str, str]] = {
    "alignment-3": (
        {"overrides": {"general.alignment": 3}},
        "'general.alignment' is 3 but must be a positive power of two",
        "read",
    ),
    "alignment-string": ({"overrides": {"general.alignment": "32"}}, "'general.alignment' is '32'", "read"),
    "missing-block-count": (
        {"overrides": {"llama.block_count": DELETE}},
        "lacks the required key 'llama.block_count'",
        "load",
    ),
    "block-count-is-string": (
        {"overrides": {"llama.block_count": "2"}},
        "'llama.block_count' is '2' \\(str\\), expected an integer",
        "load",
    ),
    "missing-architecture": ({"overrides": {"general.architecture": DELETE}}, "'general.architecture'", "load"),
    "other-architecture": ({"overrides": {"general.architecture": "gpt2"}}, "is a 'gpt2' model", "load"),
    "shape-mismatch": (
        {"overrides": {"llama.embedding_length": 32}},
        "'token_embd.weight' has shape \\(288, 64\\)",
        "load",
    ),
    "missing-tensor": (
        {"overrides": {"llama.block_count": 3}},
        "no tensor 'blk.2.attn_norm.weight'",
        "load",
    ),
    "unexpected-tensor": (
        {"extra_tensors": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}},
        "tensors a llama model as its metadata describes does not use: blk.0.attn_q.bias",
        "load",
    ),
    "heads-not-multiple-of-kv-heads": (
        {"overrides": {"llama.attention.head_count_kv": 3}},
        "'llama.attention.head_count' 4 is not a multiple of 'llama.attention.head_count_kv' 3",
        "load",
    ),
    "rope-freqs-not-positive": (
        {"rope_freqs": (-8.0, 1.0, 4.0, 64)},
        "'rope_freqs.weight' must be 8 positive numbers",
        "load",
    ),
    "linear-rope-scaling": (
        {"overrides": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}},
        "RoPE scaling 'linear'",
        "load",
    ),
    # Counts are checked against the tensor table before anything is sized by them.
    "block-count-2^32-63": (
        {"overrides": {"llama.block_count": 2**32 - 63}},
        "'llama.block_count' is 4294967233, expected an integer in 1..2147483647",
        "load",
    ),
    "block-count-past-tensor-table": (
        {"overrides": {"llama.block_count": 2**30}},
        "no tensor 'blk.2.attn_norm.weight' \\(and \\d+ more are missing; 'llama.block_count' is 1073741824\\)",
        "load",
    ),
    "head-count-2^28": (
        {"overrides": {"llama.attention.head_count": 2**28, "llama.attention.head_count_kv": 2**28}},
        "'blk.0.attn_q.weight' has shape \\(64, 64\\), not the \\(4294967296, 64\\) implied by "
        "'llama.attention.head_count' 268435456 x head size 16",
        "load",
    ),
    "head-count-kv-mismatch": (
        {"overrides": {"llama.attention.head_count_kv": 1}},
        "'blk.0.attn_k.weight' has shape \\(32, 64\\), not the \\(16, 64\\) implied by "
        "'llama.attention.head_count_kv' 1",
        "load",
    ),
    "head-count-2^40": (
        {"overrides": {"llama.attention.head_count": (2**40, GGUFValueType.UINT64)}},
        "'llama.attention.head_count' is 1099511627776, expected an integer in 1..",
        "load",
    ),
    "heads-exceed-dim-without-head-size": (
        {"overrides": {"llama.attention.head_count": 128, "llama.rope.dimension_count": DELETE}},
        "'llama.embedding_length' 64 is not a multiple of 'llama.attention.head_count' 128",
        "load",
    ),
    "ffn-length-mismatch": (
        {"overrides": {"llama.feed_forward_length": 2**31 - 1}},
        "'blk.0.ffn_gate.weight' has shape \\(128, 64\\), not the \\(2147483647, 64\\) implied by "
        "'llama.feed_forward_length' 2147483647",
        "load",
    ),
    "context-length-2^63": (
        {"overrides": {"llama.context_length": (2**63, GGUFValueType.UINT64)}},
        "'llama.context_length' is 9223372036854775808, expected an integer in 1..",
        "load",
    ),
    "rms-eps-nan": (
        {"overrides": {"llama.attention.layer_norm_rms_epsilon": float("nan")}},
        "'llama.attention.layer_norm_rms_epsilon' is nan, expected a number in \\(0, 1\\)",
        "load",
    ),
    "freq-base-array": (
        {"overrides": {"llama.rope.freq_base": np.ones(3, np.float32)}},
        "'llama.rope.freq_base' is an array of float32 with 3 entries, expected a positive number",
        "load",
    ),
    "rope-scaling-factor-string": (
        {
            "overrides": {
                "llama.rope.scaling.type": "llama3",
                "llama.rope.scaling.factor": "8",
                "llama.rope.scaling.original_context_length": 64,
            }
        },
        "'llama.rope.scaling.factor' is '8' \\(str\\), expected a positive number",
        "load",
    ),
    # The tokenizer must cover the embedding's rows exactly (llama.cpp refuses other files too).
    "fewer-tokens-than-embedding-rows": (
        {"vocab": 296, "overrides": {TOKENS: tiny_vocab(None)[0], TOKEN_TYPE: tiny_vocab(None)[1]}},
        "'tokenizer.ggml.tokens' has 288 tokens but token_embd.weight has 296 rows",
        "load",
    ),
    "more-tokens-than-embedding-rows": (
        {"overrides": {TOKENS: tiny_vocab(300)[0], TOKEN_TYPE: tiny_vocab(300)[1]}},
        "'tokenizer.ggml.tokens' has 300 tokens but token_embd.weight has 288 rows",
        "load",
    ),
    "tokens-int-array": (
        {"overrides": {TOKENS: np.arange(288, dtype=np.int32)}},
        f"'{TOKENS}' must be a non-empty array of strings, got an array of int32",
        "tokenizer",
    ),
    "scores-shorter-than-tokens": (
        {"overrides": {"tokenizer.ggml.scores": np.zeros(287, np.float32)}},
        "'tokenizer.ggml.scores' has 287 entries but there are 288 tokens",
        "tokenizer",
    ),
    "token-type-longer-than-tokens": (
        {"overrides": {TOKEN_TYPE: np.ones(300, np.int32)}},
        f"'{TOKEN_TYPE}' has 300 entries but there are 288 tokens",
        "tokenizer",
    ),
    "scores-as-strings": (
        {"overrides": {"tokenizer.ggml.scores": ["a"] * 288}},
        "'tokenizer.ggml.scores' must be an array of floats",
        "tokenizer",
    ),
    "bos-out-of-range": (
        {"overrides": {"tokenizer.ggml.bos_token_id": 5000}},
        "'tokenizer.ggml.bos_token_id' is 5000, not a token id",
        "tokenizer",
    ),
    "missing-tokenizer-model": (
        {"overrides": {"tokenizer.ggml.model": DELETE}},
        "'tokenizer.ggml.model' is missing",
        "tokenizer",
    ),
}


def assert_fails_fast(fn: Callable[[], object], error: type[Exception], match: str) -> None:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error, match=match) as info:
            fn()
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < MAX_SECONDS, f"took {elapsed:.2f} s"
    assert peak < MAX_PEAK_BYTES, f"peak traced memory {peak / 2**20:.1f} MiB"
    assert info.type is error or issubclass(info.type, error)
    message = str(info.value)
    assert "; " in message or ". " in message  # a what-to-do clause follows the diagnosis


@pytest.mark.parametrize("case", list(BYTE_CASES), ids=list(BYTE_CASES))
def test_malformed_bytes(tmp_path: Path, base: dict[str, bytes], case: str):
    (base_type, surgery), match = BYTE_CASES[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(bytes(surgery(bytearray(base[base_type]))))
    assert_fails_fast(lambda: read_gguf(path), ModelFormatError, match)


@pytest.mark.parametrize("case", list(WRITTEN_CASES), ids=list(WRITTEN_CASES))
def test_malformed_written(tmp_path: Path, case: str):
    kwargs, match, stage = WRITTEN_CASES[case]
    path = write_tiny_llama_gguf(tmp_path / f"{case}.gguf", **kwargs).path
    if stage == "read":
        assert_fails_fast(lambda: read_gguf(path), ModelFormatError, match)
    elif stage == "load":
        assert_fails_fast(lambda: load_llama_gguf(path), ModelFormatError, match)
    else:
        load_llama_gguf(path)  # the model itself is fine: only the tokenizer metadata is bad
        metadata = read_gguf(path, tensors=False).metadata
        assert_fails_fast(lambda: check_tokenizer_metadata(metadata), ModelFormatError, match)


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "nope.gguf"
    assert_fails_fast(lambda: read_gguf(missing), ModelNotFoundError, "does not exist")
    assert_fails_fast(lambda: load_llama_gguf(missing), ModelNotFoundError, "does not exist")


def test_directory_path(tmp_path: Path):
    assert_fails_fast(lambda: read_gguf(tmp_path), ModelNotFoundError, "is a directory")


def test_base_files_are_valid(base: dict[str, bytes], tmp_path: Path):
    """The corpus is only meaningful if the unmodified files load and their tokenizer metadata checks out."""
    for tensor_type, data in base.items():
        path = tmp_path / f"{tensor_type}.gguf"
        path.write_bytes(data)
        _, _, gf = load_llama_gguf(path)
        check_tokenizer_metadata(gf.metadata)
