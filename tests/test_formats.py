"""Model directories: perfx format I/O, Hugging Face float checkpoints, AutoAWQ checkpoints, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
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
    from perfx_core.errors import BackendError
    from perfx_core.quant import quantize

    tiny = write_tiny_llama_gguf(tmp_path / "t.gguf", tensor_type="F32", dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256)
    quantize(tiny.path, tmp_path / "out", method="rtn", group_size=32)
    reference = perfx_core.load(tmp_path / "out", backend="numpy", context_length=32).logits([1, 2, 3, 4])
    try:
        model = perfx_core.load(tmp_path / "out", backend=backend, context_length=32)
    except BackendError as exc:
        pytest.skip(f"{backend}: {exc}")
    np.testing.assert_allclose(model.logits([1, 2, 3, 4]), reference, atol=1e-3)
