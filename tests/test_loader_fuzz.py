"""Fuzzing the model loaders (GGUF files, safetensors files, model directories) with Hypothesis.

Every generated input must either load cleanly (and then be self-consistent) or raise a PerfxError, within the
per-example deadline and with bounded traced memory. The default run is small and derandomized (a few seconds
per loader); ``PERFX_FUZZ_EXAMPLES=N`` runs N fresh random examples per loader instead.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from tiny_gguf import write_tiny_llama_gguf

from perfx_core.errors import PerfxError
from perfx_core.formats import load_directory
from perfx_core.formats.safetensors_io import DTYPES, SafetensorsFile
from perfx_core.gguf_file import read_gguf
from perfx_core.gguf_loader import load_llama_gguf
from perfx_core.tokenizer import tokenizer_from_metadata

MAX_PEAK_BYTES = 64 << 20
EXAMPLES = int(os.environ.get("PERFX_FUZZ_EXAMPLES", "0"))
_COMMON = dict(deadline=timedelta(seconds=2), database=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("perfx-fuzz", max_examples=100, derandomize=True, **_COMMON)
settings.register_profile("perfx-fuzz-long", max_examples=max(EXAMPLES, 1), derandomize=False, **_COMMON)
FUZZ = settings.get_profile("perfx-fuzz-long" if EXAMPLES else "perfx-fuzz")


def loads_or_refuses(fn: Callable[[], Any]) -> Any:
    """fn()'s result, or None when it raised a PerfxError; anything else (or too much memory) fails the test."""
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re-quantization notes for tensor types a mutation produced
            try:
                result = fn()
                event("loaded")
            except PerfxError as e:
                result = None
                event(f"refused: {type(e).__name__}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK_BYTES, f"peak traced memory {peak / 2**20:.1f} MiB"
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# -- GGUF ---------------------------------------------------------------------------------------------------

INTERESTING = (0, 1, 2, 3, 7, 8, 31, 32, 2**31 - 1, 2**31, 2**32 - 63, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)


@pytest.fixture(scope="module")
def gguf_bases(work: Path) -> list[tuple[bytes, int]]:
    """(file bytes, where tensor data starts) of small valid GGUFs: F32 tied and Q8_0 untied."""
    out = []
    for i, (t, tied) in enumerate((("F32", True), ("Q8_0", False))):
        path = write_tiny_llama_gguf(work / f"base{i}.gguf", tensor_type=t, tied=tied, n_layers=1).path
        out.append((path.read_bytes(), read_gguf(path).data_offset))
    return out


def _mutation(header_end: int, size: int) -> st.SearchStrategy:
    # Most positions fall in the header (metadata and tensor table), where a byte changes what is parsed.
    pos = st.one_of(st.integers(0, header_end - 1), st.integers(0, header_end - 1), st.integers(0, size - 1))
    return st.one_of(
        st.tuples(st.just("byte"), pos, st.integers(0, 255)),
        st.tuples(st.just("u32"), pos, st.sampled_from(INTERESTING).map(lambda v: v & 0xFFFFFFFF)),
        st.tuples(st.just("u64"), pos, st.sampled_from(INTERESTING)),
        st.tuples(st.just("cut"), pos, st.just(0)),
        st.tuples(st.just("insert"), pos, st.integers(1, 16)),
    )


def _apply(data: bytearray, mutations: list[tuple[str, int, int]]) -> bytearray:
    for kind, pos, value in mutations:
        pos = min(pos, max(len(data) - 1, 0))
        if kind == "byte" and data:
            data[pos] = value
        elif kind == "u32":
            data[pos : pos + 4] = struct.pack("<I", value)
        elif kind == "u64":
            data[pos : pos + 8] = struct.pack("<Q", value)
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = bytes(value)
    return data


def load_gguf_everything(path: Path) -> None:
    config, _, gf = load_llama_gguf(path)
    tokenizer = tokenizer_from_metadata(gf.metadata)
    # A clean load is a consistent one: every id the tokenizer makes has an embedding row, and back.
    assert tokenizer.vocab_size == config.vocab_size
    tokenizer.decode(tokenizer.encode("hello there <|im_end|>", parse_special=True))


@FUZZ
@given(data=st.data())
def test_gguf_byte_mutations(work: Path, gguf_bases: list[tuple[bytes, int]], data: st.DataObject):
    base, header_end = gguf_bases[data.draw(st.integers(0, len(gguf_bases) - 1), label="base")]
    mutations = data.draw(st.lists(_mutation(header_end, len(base)), min_size=1, max_size=4), label="mutations")
    path = work / "mutated.gguf"
    path.write_bytes(bytes(_apply(bytearray(base), mutations)))
    loads_or_refuses(lambda: load_gguf_everything(path))


def _gguf_value() -> st.SearchStrategy:
    ints = st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1))
    return st.one_of(
        st.tuples(st.one_of(ints.filter(lambda v: v < 2**32), st.integers(0, 300)), st.just(GGUFValueType.UINT32)),
        st.tuples(ints, st.just(GGUFValueType.UINT64)),
        st.tuples(st.integers(-(2**31), 2**31 - 1), st.just(GGUFValueType.INT32)),
        st.tuples(st.floats(width=32), st.just(GGUFValueType.FLOAT32)),
        st.tuples(st.floats(), st.just(GGUFValueType.FLOAT64)),
        st.tuples(st.booleans(), st.just(GGUFValueType.BOOL)),
        st.tuples(st.text(max_size=12), st.just(GGUFValueType.STRING)),
        _array(st.integers(-5, 300), GGUFValueType.INT32),
        _array(st.text(max_size=4), GGUFValueType.STRING),
    )


def _array(elements: st.SearchStrategy, element_type: GGUFValueType) -> st.SearchStrategy:
    # The gguf writer cannot write an empty array.
    return st.tuples(st.lists(elements, min_size=1, max_size=6), st.just(GGUFValueType.ARRAY), st.just(element_type))


GGUF_KEYS = (
    "general.architecture", "general.name", "general.alignment", "llama.block_count", "llama.context_length",
    "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.attention.key_length", "llama.attention.value_length",
    "llama.rope.dimension_count", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size", "llama.rope.scaling.type", "llama.rope.scaling.factor",
    "llama.rope.scaling.original_context_length", "llama.rope.scaling.low_freq_factor",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
)  # fmt: skip


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(GGUF_KEYS), st.none() | _gguf_value(), min_size=1, max_size=3))
# Counts that once sized allocations before the tensor table was consulted.
@example(overrides={"llama.block_count": (2**32 - 63, GGUFValueType.UINT32)})
@example(overrides={"llama.attention.head_count": (2**28, GGUFValueType.UINT32),
                    "llama.attention.head_count_kv": (2**28, GGUFValueType.UINT32)})  # fmt: skip
def test_gguf_metadata_values(work: Path, overrides: dict[str, Any]):
    # None deletes the key (tiny_gguf.DELETE); the rest are typed GGUF values.
    path = work / "metadata.gguf"
    write_tiny_llama_gguf(path, n_layers=1, overrides=overrides)
    loads_or_refuses(lambda: load_gguf_everything(path))


# -- safetensors ----------------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.just(10**400), st.floats(), st.text(max_size=6)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
DIM = st.one_of(st.integers(0, 6), st.sampled_from([-1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64]))
OFFSET = st.one_of(st.integers(0, 64), st.sampled_from([-1, 2**63, 2**64]))
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from([*DTYPES, "F8_E4M3", "U32"]), JSON_SCALARS),
        "shape": st.one_of(st.lists(DIM, max_size=3), JSON),
        "data_offsets": st.one_of(st.lists(OFFSET, min_size=2, max_size=2), JSON),
    }
)
HEADER = st.dictionaries(st.text(max_size=4), st.one_of(ENTRY, ENTRY, JSON), max_size=4)


@FUZZ
@given(
    header=HEADER,
    metadata=st.one_of(st.none(), JSON),
    payload=st.binary(max_size=64),
    depth=st.sampled_from([0, 0, 0, 100, 100_000]),
)
def test_safetensors_headers(work: Path, header: dict, metadata: Any, payload: bytes, depth: int):
    if metadata is not None:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode() if not depth else b"[" * depth + b"]" * depth
    path = work / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)

    def read() -> None:
        f = SafetensorsFile(path)
        spans = []
        for name, entry in f.entries.items():
            try:
                view = f.get(name)
            except PerfxError:
                continue  # a dtype perfx cannot view
            assert view.nbytes == entry.end - entry.begin
            if view.nbytes:
                spans.append((entry.begin, entry.end))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))

    loads_or_refuses(read)


# -- model directories ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(work: Path) -> dict[str, Path]:
    """A sharded Hugging Face directory and a perfx directory of one tiny model."""
    from perfx_core.formats.hf_export import gguf_to_hf
    from perfx_core.quant import quantize

    tiny = write_tiny_llama_gguf(work / "dir-src.gguf", tensor_type="F32", tied=False, n_layers=2)
    hf = gguf_to_hf(tiny.path, work / "hf", layers_per_shard=1)
    quantize(tiny.path, work / "perfx", method="rtn", group_size=32)
    return {"hf": hf, "perfx": work / "perfx"}


# (directory, file, keys whose values are replaced; "" replaces the whole file's object)
DIR_TARGETS = (
    ("hf", "config.json", ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                           "vocab_size", "tie_word_embeddings", "rope_scaling", "rope_parameters", "model_type",
                           "architectures", "quantization_config", "_name_or_path", "hidden_act", "")),
    ("hf", "model.safetensors.index.json", ("weight_map", "")),
    ("hf", "tokenizer_config.json", ("add_bos_token", "add_eos_token", "bos_token", "eos_token", "chat_template", "")),
    ("perfx", "perfx.json", ("format", "format_version", "config", "")),
    ("perfx", "perfx.json", ("config.n_layers", "config.dim", "config.norm_eps", "config.rope_theta",
                             "config.rope_scaling", "config.rope_freq_divisors", "config.tied_embeddings",
                             "config.head_dim", "config.n_kv_heads", "config.vocab_size")),
    ("perfx", "tokenizer.gguf.json", ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.model",
                                      "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "")),
)  # fmt: skip
SHARD_NAMES = st.sampled_from(
    ["../x.safetensors", "/etc/hostname", "a/../../b", "C:\\x", "", "model.safetensors", "x" * 300, "a\x00b"]
)


def _set(obj: dict, dotted: str, value: Any) -> Any:
    """``obj`` with the value at ``dotted`` ("config.x" is nested in perfx.json) replaced or deleted."""
    if not dotted:
        return value
    head, _, rest = dotted.partition(".")
    if rest and head == "config" and isinstance(obj.get(head), dict):
        obj[head] = _set(dict(obj[head]), rest, value)
    elif value is _DELETE:
        obj.pop(dotted, None)
    else:
        obj[dotted] = value
    return obj


_DELETE = object()


@FUZZ
@given(data=st.data())
def test_directory_json(model_dirs: dict[str, Path], data: st.DataObject):
    kind, name, keys = data.draw(st.sampled_from(DIR_TARGETS), label="target")
    key = data.draw(st.sampled_from(keys), label="key")
    directory = model_dirs[kind]
    path = directory / name
    original = path.read_bytes()
    raw = json.loads(original)
    if key == "weight_map":  # each tensor keeps its shard or gets another (outside the directory, or not a name)
        shards = st.one_of(SHARD_NAMES, JSON_SCALARS)
        value: Any = {k: data.draw(st.just(v) | shards) for k, v in raw["weight_map"].items()}
    else:
        value = data.draw(st.one_of(st.just(_DELETE), JSON, st.sampled_from([0, -1, 2**32 - 63, float("inf")])))
    try:
        obj = _set(raw, key, value)
        path.write_text(json.dumps(obj) if obj is not _DELETE else "", encoding="utf-8")
        loaded = loads_or_refuses(lambda: load_directory(directory))
    finally:
        path.write_bytes(original)
    if loaded is not None:
        assert loaded.tokenizer.vocab_size <= loaded.config.vocab_size
        assert len(loaded.weights.layers) == loaded.config.n_layers


def test_directory_fixtures_load(model_dirs: dict[str, Path]):
    """The fuzzed directories are valid to begin with, so each mutation is what a refusal is about."""
    for directory in model_dirs.values():
        assert load_directory(directory).config.n_layers == 2
