"""Model directories: perfx format I/O, Hugging Face float checkpoints, AutoAWQ checkpoints, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from backend_availability import skip_unless_available
from tiny_gguf import write_tiny_llama_gguf

import perfx_core
from perfx_core.errors import ModelFormatError, PerfxError
from perfx_core.formats import directory_kind, load_directory
from perfx_core.formats.awq_checkpoint import AWQ_PACK_ORDER, load_awq_directory, unpack_awq_int32
from perfx_core.formats.hf import load_hf_directory
from perfx_core.formats.hf_export import gguf_to_hf
from perfx_core.formats.safetensors_io import SafetensorsFile, StreamingWriter
from perfx_core.weights import dequantize


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random Llama (2 blocks, dim 64, GQA) as a float32 HF directory with a byte-level BPE tokenizer."""
    tmp = tmp_path_factory.mktemp("tiny")
    tiny = write_tiny_llama_gguf(tmp / "tiny.gguf", tensor_type="F32", tied=False, seed=3)
    return tiny, gguf_to_hf(tiny.path, tmp / "hf", layers_per_shard=1)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_streaming_writer_is_plain_safetensors_and_reader_maps_views(tmp_path):
    from safetensors import safe_open

    arrays = {
        "a": np.arange(6, dtype=np.float16).reshape(2, 3),
        "b": np.arange(5, dtype=np.uint8),
        "c": np.ones(3, np.float32),
    }
    w = StreamingWriter(tmp_path / "x.safetensors", {k: (v.dtype, v.shape) for k, v in arrays.items()}, {"k": "v"})
    for name in ("b", "c", "a"):  # any order
        w.write(name, arrays[name])
    w.close()
    with safe_open(str(tmp_path / "x.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(k), v)
    f2 = SafetensorsFile(tmp_path / "x.safetensors")
    for k, v in arrays.items():
        got = f2.get(k)
        np.testing.assert_array_equal(got, v)
        assert isinstance(got.base, np.ndarray) and not got.flags.writeable  # a read-only view of the map
        assert got.ctypes.data % got.dtype.itemsize == 0  # aligned


def test_hf_directory_loads_as_views_and_matches_the_gguf(tiny_hf):
    tiny, hf = tiny_hf
    assert sorted(p.name for p in hf.glob("*.safetensors"))[0].startswith("model-00001-of-")
    assert directory_kind(hf) == "hf"
    config, weights = load_hf_directory(hf)
    assert config.n_layers == 2 and not config.tied_embeddings
    assert not weights.layers[0].wq.data.flags.writeable  # fp32 stays a view of the file
    gguf_model = perfx_core.load(tiny.path, context_length=64)
    hf_model = perfx_core.load(hf, context_length=64)
    ids = gguf_model.tokenizer.encode("hello there, the hat is on the chair")
    assert hf_model.tokenizer.encode("hello there, the hat is on the chair") == ids
    np.testing.assert_allclose(hf_model.logits(ids), gguf_model.logits(ids), rtol=1e-5, atol=1e-5)
    rtn = load_directory(hf, quantize="rtn")
    assert type(rtn.weights.layers[0].wq).__name__ == "Int4Weight"


def test_smollm2_tokenizer_json_matches_gguf_tokenizer(smollm2_path, tmp_path):
    from perfx_core.formats.hf_export import write_bpe_tokenizer
    from perfx_core.formats.hf_tokenizer import tokenizer_for_directory
    from perfx_core.gguf_file import read_gguf
    from perfx_core.quant.calibration import HELDOUT_TEXT, read_text
    from perfx_core.tokenizer import load_tokenizer

    write_bpe_tokenizer(read_gguf(smollm2_path, tensors=False).metadata, tmp_path)
    ours, meta = tokenizer_for_directory(tmp_path)
    ref = load_tokenizer(smollm2_path)
    text = read_text(HELDOUT_TEXT) + " <|im_start|>user 12345 café\n"
    for parse in (False, True):
        ids = ours.encode(text, add_special=True, parse_special=parse)
        assert ids == ref.encode(text, add_special=True, parse_special=parse)
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.eos_ids == ref.eos_ids and ours.bos_id == ref.bos_id
    assert "tokenizer.chat_template" in meta


# -- AutoAWQ --------------------------------------------------------------------------------------------------


def pack_like_autoawq(codes: np.ndarray) -> np.ndarray:
    """Independent packer: (rows, cols) codes -> int32 (rows, cols/8), nibble i of pack c holding column 8c+ORDER[i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map, written out again on purpose
    rows, cols = codes.shape
    out = np.zeros((rows, cols // 8), dtype=np.int64)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= codes[:, 8 * c + order[i]].astype(np.int64) << (4 * i)
    return out.astype(np.uint32).view(np.int32)


def test_awq_nibble_order():
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    codes = np.random.default_rng(0).integers(0, 16, (3, 16)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_awq_int32(pack_like_autoawq(codes)), codes)
    # One word by hand: columns 0..7 hold 1..8 -> nibbles (low first) hold columns 0,2,4,6,1,3,5,7 = 1,3,5,7,2,4,6,8.
    assert unpack_awq_int32(np.array([[0x86427531]], dtype=np.uint32).view(np.int32)).tolist() == [
        [1, 2, 3, 4, 5, 6, 7, 8]
    ]


def write_awq_checkpoint(hf_dir, out, group=32, seed=0):
    """Replace every linear of an HF directory by known int4 codes in AutoAWQ's GEMM layout; returns the values."""
    from safetensors.numpy import save_file

    from perfx_core.formats.hf import HFCheckpoint

    rng = np.random.default_rng(seed)
    ckpt = HFCheckpoint(hf_dir)
    tensors, expected = {}, {}
    for key in ckpt.keys():
        data, _ = ckpt.raw(key)
        if key.endswith("proj.weight"):
            out_f, in_f = data.shape
            q = rng.integers(0, 16, (in_f, out_f))
            z = rng.integers(0, 16, (in_f // group, out_f))
            s = (0.001 + 0.01 * rng.random((in_f // group, out_f))).astype(np.float16)
            prefix = key[: -len(".weight")]
            tensors[prefix + ".qweight"] = pack_like_autoawq(q)
            tensors[prefix + ".qzeros"] = pack_like_autoawq(z)
            tensors[prefix + ".scales"] = s
            w_in_out = (q - np.repeat(z, group, axis=0)) * np.repeat(s.astype(np.float64), group, axis=0)
            expected[key] = w_in_out.T  # (out, in)
        else:
            tensors[key] = np.array(data, dtype=np.float16)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, out / f)
    return expected


def test_autoawq_checkpoint_loads_exact_values(tiny_hf, tmp_path):
    _, hf = tiny_hf
    expected = write_awq_checkpoint(hf, tmp_path / "awq")
    assert directory_kind(tmp_path / "awq") == "awq"
    config, weights = load_awq_directory(tmp_path / "awq")
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}  # fmt: skip
    for i, layer in enumerate(weights.layers):
        for attr, module in names.items():
            w = getattr(layer, attr)
            assert w.group_size == 32
            np.testing.assert_array_equal(dequantize(w, np.float64), expected[f"model.layers.{i}.{module}.weight"])
    model = perfx_core.load(tmp_path / "awq", context_length=32)
    assert np.isfinite(model.logits([1, 2, 3])).all()


# -- bad input -----------------------------------------------------------------------------------------------


def test_bad_hf_directories_raise_perfx_errors(tiny_hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    from perfx_core.quant import quantize

    _, hf = tiny_hf
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]

    missing = copy_dir(hf, tmp_path / "missing")
    (missing / shard).unlink()
    with pytest.raises(ModelFormatError, match="missing"):
        quantize(missing, tmp_path / "o1", method="rtn")

    def edit(name, fn):
        d = copy_dir(hf, tmp_path / name)
        tensors = load_file(str(d / shard))
        tensors["model.layers.1.mlp.up_proj.weight"] = fn(tensors["model.layers.1.mlp.up_proj.weight"])
        save_file(tensors, str(d / shard))
        return d

    with pytest.raises(ModelFormatError, match="dtype I32"):
        quantize(edit("dtype", lambda a: a.astype(np.int32)), tmp_path / "o2", method="rtn")
    with pytest.raises(ModelFormatError, match="shape"):
        quantize(edit("shape", lambda a: a[:-1]), tmp_path / "o3", method="rtn")
    with pytest.raises(ModelFormatError, match="shape"):
        perfx_core.load(tmp_path / "shape")

    arch = copy_dir(hf, tmp_path / "arch")
    cfg = json.loads((arch / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="gpt2"):
        quantize(arch, tmp_path / "o4", method="rtn")
    with pytest.raises(PerfxError):
        perfx_core.load(arch)
    assert not any(p.name.startswith(("o1", "o2", "o3", "o4", ".o")) for p in tmp_path.iterdir())

    broken = copy_dir(hf, tmp_path / "broken")
    (broken / shard).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelFormatError):
        load_directory(broken)


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_perfx_directory_runs_on_every_backend(tmp_path, backend):
    from perfx_core.quant import quantize

    skip_unless_available(backend)  # only where OpenCL cannot run at all (and never in CI): other errors fail
    tiny = write_tiny_llama_gguf(tmp_path / "t.gguf", tensor_type="F32", dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256)
    quantize(tiny.path, tmp_path / "out", method="rtn", group_size=32)
    reference = perfx_core.load(tmp_path / "out", backend="numpy", context_length=32).logits([1, 2, 3, 4])
    model = perfx_core.load(tmp_path / "out", backend=backend, context_length=32)
    np.testing.assert_allclose(model.logits([1, 2, 3, 4]), reference, atol=1e-3)


# -- malformed metadata: every bad value is a typed error naming the file, the key and the value ---------------


def _with_json(src, dst, name, edit):
    """A copy of model directory ``src`` whose JSON file ``name`` is changed by ``edit`` (dict -> dict or text)."""
    d = copy_dir(src, dst)
    path = d / name
    new = edit(json.loads(path.read_text()) if path.is_file() else {})
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    return d, path


def _update(**changes):
    return lambda raw: {**raw, **changes}


HF_CONFIG_CASES = {
    "kv-heads-string": (
        _update(num_key_value_heads="2"),
        "'num_key_value_heads' is '2' \\(str\\), expected an integer",
    ),
    "rope-scaling-string": (_update(rope_scaling="llama3"), "'rope_scaling' is 'llama3' \\(str\\), expected an object"),
    "rms-norm-eps-null": (_update(rms_norm_eps=None), "'rms_norm_eps' is None, expected a number"),
    "max-positions-infinite": (
        _update(max_position_embeddings=float("inf")),
        "'max_position_embeddings' is inf \\(float\\), expected an integer",
    ),
    "hidden-size-float": (_update(hidden_size=64.0), "'hidden_size' is 64.0 \\(float\\), expected an integer"),
    "vocab-size-bool": (_update(vocab_size=True), "'vocab_size' is True \\(bool\\), expected an integer"),
    "layers-zero": (_update(num_hidden_layers=0), "'num_hidden_layers' is 0, expected an integer in 1.."),
    "head-dim-odd": (_update(head_dim=15), "'head_dim' 15 is odd"),
    "heads-not-multiple-of-kv": (
        _update(num_key_value_heads=3),
        "'num_attention_heads' 4 is not a multiple of 'num_key_value_heads' 3",
    ),
    "eps-huge-integer": (_update(rms_norm_eps=10**400), "'rms_norm_eps' is 1000.*, expected a number in \\(0, 1\\)"),
    "rope-theta-negative": (_update(rope_theta=-1.0), "'rope_theta' is -1.0, expected a positive number"),
    "rope-factor-string": (
        _update(rope_scaling={"rope_type": "llama3", "factor": "8", "original_max_position_embeddings": 64}),
        "'rope_scaling.factor' is '8' \\(str\\), expected a positive number",
    ),
    "rope-scaling-no-original-ctx": (
        _update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        "lacks the required key 'rope_scaling.original_max_position_embeddings'",
    ),
    "rope-type-list": (_update(rope_scaling={"rope_type": ["llama3"]}), "'rope_scaling.rope_type' is \\['llama3'\\]"),
    "tie-embeddings-string": (_update(tie_word_embeddings="false"), "'tie_word_embeddings' is 'false' \\(str\\)"),
    "architectures-int": (_update(model_type="gpt2", architectures=5), "model_type 'gpt2'"),
    "name-list": (_update(_name_or_path=["x"]), "'_name_or_path' is \\['x'\\]"),
}


@pytest.mark.parametrize("case", list(HF_CONFIG_CASES), ids=list(HF_CONFIG_CASES))
def test_bad_config_json_is_a_model_format_error(tiny_hf, tmp_path, case):
    edit, match = HF_CONFIG_CASES[case]
    d, path = _with_json(tiny_hf[1], tmp_path / "m", "config.json", edit)
    with pytest.raises(ModelFormatError, match=match) as info:
        load_directory(d)
    assert str(path) in str(info.value)


@pytest.fixture(scope="module")
def tiny_perfx(tmp_path_factory):
    """A tiny perfx directory (int4, tokenizer kept as tokenizer.gguf.json)."""
    from perfx_core.quant import quantize

    tmp = tmp_path_factory.mktemp("perfx")
    tiny = write_tiny_llama_gguf(tmp / "t.gguf", tensor_type="F32", dim=64, ffn_dim=128)
    quantize(tiny.path, tmp / "out", method="rtn", group_size=32)
    return tmp / "out"


def _config_update(**changes):
    return lambda meta: {**meta, "config": {**meta["config"], **changes}}


PERFX_JSON_CASES = {
    "layers-zero": (_config_update(n_layers=0), "'config.n_layers' is 0, expected an integer in 1.."),
    "norm-eps-string": (_config_update(norm_eps="1e-5"), "'config.norm_eps' is '1e-5' \\(str\\), expected a number"),
    "rope-scaling-string": (_config_update(rope_scaling="x"), "'config.rope_scaling' is 'x' \\(str\\)"),
    "rope-scaling-extra-key": (
        _config_update(rope_scaling={"factor": 8.0, "original_context_length": 64, "bogus": 1}),
        "'config.rope_scaling' has unknown key 'bogus'",
    ),
    "divisors-with-string": (
        _config_update(rope_freq_divisors=[1.0] * 7 + ["a"]),
        "'config.rope_freq_divisors' must be 8 positive numbers",
    ),
    "divisors-too-few": (_config_update(rope_freq_divisors=[1.0]), "'config.rope_freq_divisors' must be 8"),
    "missing-dim": (
        lambda m: {**m, "config": {k: v for k, v in m["config"].items() if k != "dim"}},
        "lacks the required key 'config.dim'",
    ),
    "config-a-list": (lambda m: {**m, "config": [1, 2]}, "'config' is \\[1, 2\\]"),
    "tied-int": (_config_update(tied_embeddings=1), "'config.tied_embeddings' is 1 \\(int\\), expected true or false"),
}


@pytest.mark.parametrize("case", list(PERFX_JSON_CASES), ids=list(PERFX_JSON_CASES))
def test_bad_perfx_json_is_a_model_format_error(tiny_perfx, tmp_path, case):
    edit, match = PERFX_JSON_CASES[case]
    d, path = _with_json(tiny_perfx, tmp_path / "m", "perfx.json", edit)
    with pytest.raises(ModelFormatError, match=match) as info:
        load_directory(d)
    assert str(path) in str(info.value)


TOKENIZER_FILE_CASES = {
    "tokenizer-config-not-json": ("hf", "tokenizer_config.json", lambda _: "{not json", "is not valid JSON"),
    "tokenizer-config-a-list": ("hf", "tokenizer_config.json", lambda _: [1], "must hold a JSON object"),
    "tokenizer-config-add-bos-string": (
        "hf",
        "tokenizer_config.json",
        _update(add_bos_token="yes"),
        "'add_bos_token' is 'yes' \\(str\\), expected true or false",
    ),
    "tokenizer-config-template-int": ("hf", "tokenizer_config.json", _update(chat_template=3), "'chat_template' is 3"),
    "gguf-tokenizer-not-json": ("perfx", "tokenizer.gguf.json", lambda _: "[", "is not valid JSON"),
    "gguf-tokenizer-a-list": ("perfx", "tokenizer.gguf.json", lambda _: [1, 2], "must hold a JSON object"),
    "gguf-tokenizer-bad-dtype": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.token_type": {"__ndarray__": "bogus", "data": [1]}}),
        "'tokenizer.ggml.token_type' has array type 'bogus'",
    ),
    "gguf-tokenizer-object-dtype": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.token_type": {"__ndarray__": "|O", "data": [1]}}),
        "'tokenizer.ggml.token_type' has array type '\\|O'",
    ),
    "gguf-tokenizer-ragged-data": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.token_type": {"__ndarray__": "<i4", "data": [[1], [1, 2]]}}),
        "'tokenizer.ggml.token_type' must hold a flat list of numbers",
    ),
    "gguf-tokenizer-merges-null": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.merges": [None]}),
        "'tokenizer.ggml.merges' must be an array of strings, but entry 0 is a NoneType \\(None\\)",
    ),
    "gguf-tokenizer-plain-ragged-token-type": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.token_type": [None, []]}),
        "'tokenizer.ggml.token_type' must be an array of integers, got \\[None, \\[\\]\\]",
    ),
    "gguf-tokenizer-token-type-past-int32": (
        "perfx",
        "tokenizer.gguf.json",
        lambda m: {**m, "tokenizer.ggml.token_type": [2**40 + 1] * len(m["tokenizer.ggml.tokens"])},
        "'tokenizer.ggml.token_type' holds values outside int32",
    ),
    "gguf-tokenizer-model-a-list": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.model": ["gpt2"]}),
        "'tokenizer.ggml.model' must be a tokenizer name .* got \\['gpt2'\\]",
    ),
    "gguf-tokenizer-data-strings": (
        "perfx",
        "tokenizer.gguf.json",
        _update(**{"tokenizer.ggml.token_type": {"__ndarray__": "<i4", "data": "abc"}}),
        "'tokenizer.ggml.token_type' must hold a flat list of numbers",
    ),
}


@pytest.mark.parametrize("case", list(TOKENIZER_FILE_CASES), ids=list(TOKENIZER_FILE_CASES))
def test_bad_tokenizer_files_are_tokenizer_errors(tiny_hf, tiny_perfx, tmp_path, case):
    from perfx_core.errors import TokenizerError

    kind, name, edit, match = TOKENIZER_FILE_CASES[case]
    d, path = _with_json(tiny_hf[1] if kind == "hf" else tiny_perfx, tmp_path / "m", name, edit)
    with pytest.raises(TokenizerError, match=match) as info:
        load_directory(d)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("field", ["bits", "group_size"])
def test_awq_sizes_must_be_integers(tiny_hf, tmp_path, field):
    write_awq_checkpoint(tiny_hf[1], tmp_path / "awq")
    config_path = tmp_path / "awq" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"][field] = float(config["quantization_config"][field])  # 4.0 / 32.0
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="AWQ with 4(.0)? bits and group 32(.0)? is not supported"):
        load_directory(tmp_path / "awq")


# -- safetensors headers and shard paths ----------------------------------------------------------------------


def _safetensors(path, header, data=b""):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


SAFETENSORS_CASES = {
    "dim-2^64": (
        {"a": {"dtype": "F32", "shape": [2**64], "data_offsets": [0, 4]}},
        "'a' has shape \\[18446744073709551616\\]",
    ),
    "dims-product-overflows": (
        {"a": {"dtype": "U8", "shape": [2**40, 2**40], "data_offsets": [0, 4]}},
        "'a' has 4 bytes but dtype U8 and shape \\[1099511627776, 1099511627776\\] need 1208925819614629174706176",
    ),
    "too-many-dims": ({"a": {"dtype": "U8", "shape": [1] * 100, "data_offsets": [0, 1]}}, "'a' has shape \\[1, 1, "),
    "shape-a-string": ({"a": {"dtype": "U8", "shape": "12", "data_offsets": [0, 2]}}, "'a' has shape '12'"),
    "negative-dim": ({"a": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, "'a' has shape \\[-2\\]"),
    "offsets-floats": (
        {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2.5]}},
        "'a' has data_offsets \\[0, 2.5\\]",
    ),
    "offsets-reversed": (
        {"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}},
        "'a' has data_offsets \\[4, 0\\]",
    ),
    "entry-a-list": ({"a": [1]}, "tensor 'a' has a malformed header entry"),
    "dtype-int": ({"a": {"dtype": 7, "shape": [2], "data_offsets": [0, 2]}}, "'a' has dtype 7"),
    "metadata-a-list": ({"__metadata__": [1]}, "'__metadata__' must map strings to strings"),
    "metadata-values-ints": ({"__metadata__": {"format": 1}}, "'__metadata__' must map strings to strings"),
    "deep-nesting": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "overlap": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        "tensors 'a' and 'b' overlap",
    ),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES), ids=list(SAFETENSORS_CASES))
def test_bad_safetensors_headers(tmp_path, case):
    header, match = SAFETENSORS_CASES[case]
    path = _safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(ModelFormatError, match=match) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_safetensors_zero_size_tensors_do_not_overlap(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "c": {"dtype": "F32", "shape": [0, 3], "data_offsets": [4, 4]},
    }
    f = SafetensorsFile(_safetensors(tmp_path / "x.safetensors", header, bytes(4)))
    assert f.get("a").shape == (0,) and f.get("c").shape == (0, 3) and f.get("b").shape == (1,)


@pytest.mark.parametrize("where", ["parent", "absolute", "nested-parent"])
def test_index_shards_must_stay_inside_the_model_directory(tiny_hf, tmp_path, where):
    d = copy_dir(tiny_hf[1], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(d / shard, outside)
    ref = {
        "parent": "../outside.safetensors",
        "absolute": str(outside),
        "nested-parent": "sub/../../outside.safetensors",
    }
    index["weight_map"] = {k: (ref[where] if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    (d / "sub").mkdir()
    with pytest.raises(ModelFormatError, match="names a shard outside the model directory") as info:
        load_directory(d)
    assert ref[where] in str(info.value)


@pytest.mark.parametrize("shard", ["x" * 300 + ".safetensors", "a\x00b.safetensors", 7])
def test_index_shard_names_that_no_file_can_have(tiny_hf, tmp_path, shard):
    d = copy_dir(tiny_hf[1], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="shard .* (is missing|not a file name)") as info:
        load_directory(d)
    assert str(index_path) in str(info.value) or "model.safetensors.index.json" in str(info.value)


def test_embedding_rows_past_the_tokenizer_are_never_sampled(tiny_hf, tmp_path):
    """A checkpoint whose embedding is padded past its tokenizer (common on the Hub): perfx keeps the tokenizer's
    rows, so no padded id can be sampled, and the logits it keeps are transformers' own."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, hf = tiny_hf
    n_tokens = perfx_core.load(hf, context_length=64).tokenizer.vocab_size
    cfg = transformers.LlamaConfig(
        vocab_size=n_tokens + 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        reference.lm_head.weight[n_tokens:] = 100.0  # padded rows that would win every draw
    reference.save_pretrained(tmp_path / "padded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, tmp_path / "padded" / name)
    model = perfx_core.load(tmp_path / "padded", context_length=64)
    assert model.config.vocab_size == n_tokens
    ids = model.tokenizer.encode("hello there, the hat is on the chair")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, :, :n_tokens].numpy()
    np.testing.assert_allclose(model.logits(ids), expected, rtol=1e-4, atol=1e-4)
    assert all(e.id < n_tokens for e in model.generate(ids, max_tokens=8, temperature=1.5, seed=1))
