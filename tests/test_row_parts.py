"""A fused matrix whose parts come in different formats (a Q4_K_M file's QKV: q and k Q4_K, v Q6_K in the layers
llama.cpp gives more bits) keeps each part's format instead of widening all of them to float32, and computes the
same logits: against transformers loading the same file, on every built-in backend, through prefill (each part
into a scratch, then its columns) and decode (each part into a view of the output row)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backend_availability import open_runtime_or_skip
from logits_tolerance import assert_same_logits

import perfx_core
from perfx_core.row_parts import PreparedRowParts
from perfx_core.weights import Int4Weight, Int8Weight, RowParts, concat_rows, dequantize, quantize_rtn

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"
# Two layers: llama.cpp's rule gives layer 1 (not layer 0) a Q6_K attn_v and ffn_down.
TINY_Q4_K_M = ("--layers", "2", "--dim", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "4", "--type", "q4_k_m")
# Token ids of the file's 32,000-token vocabulary (timing and exactness do not depend on which).
PROMPT = [1, 450, 7205, 472, 4646, 338, 263, 2215, 310, 5014, 322, 4766, 29889, 450, 11315, 1016]


def test_int4_next_to_int8_stays_in_parts():
    rng = np.random.default_rng(0)
    q = quantize_rtn(rng.standard_normal((64, 128)).astype(np.float32), 32)
    v = Int8Weight(rng.integers(-32, 32, (32, 128), dtype=np.int8), rng.random((32, 8), np.float32), 16)
    fused = concat_rows([q, q, v])
    # q|k of one format share a matrix; v keeps its own.
    assert isinstance(fused, RowParts) and [type(p) for p in fused.parts] == [Int4Weight, Int8Weight]
    assert fused.parts[1] is v and fused.parts[0].shape == (128, 128)
    assert fused.shape == (160, 128) and fused.nbytes == 2 * q.nbytes + v.nbytes
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(q), dequantize(q), dequantize(v)]))
    # Formats that one matrix holds exactly are still fused into one.
    assert isinstance(concat_rows([q, q]), Int4Weight)
    assert isinstance(concat_rows([v, v]), Int8Weight)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "make_synthetic_gguf.py"), str(out), "--vocab", str(VOCAB),
         *TINY_Q4_K_M],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def expected_logits(q4_k_m_file) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        q4_k_m_file.parent, gguf_file=q4_k_m_file.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return reference(torch.tensor([PROMPT])).logits[0].numpy()


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got - want) ** 2).mean() / (want**2).mean())


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
def test_q4_k_m_qkv_in_parts_matches_transformers(backend, q4_k_m_file, expected_logits):
    if backend == "opencl":
        open_runtime_or_skip("opencl").close()
    model = perfx_core.load(q4_k_m_file, backend=backend, context_length=64)
    try:
        layers = model.engine.layers
        assert not isinstance(layers[0].w_qkv, PreparedRowParts)  # q, k, v all Q4_K: one int4 matrix
        mixed = layers[1].w_qkv
        assert isinstance(mixed, PreparedRowParts)
        v_kind = "int6" if "int6" in model.engine.rt.weight_formats else "int8"  # Q6_K's own form, or its int8 one
        assert [p.kind for p in mixed.parts] == ["int4", v_kind] and mixed.shape == (768, 256)
        # Prefill: every prompt row at once.
        got = model.logits(PROMPT)
        assert nmse(got, expected_logits) < 1e-5
        assert (got.argmax(1) == expected_logits.argmax(1)).all()
        # Decode: one row at a time after a prefix, as the prompt's rows (a misplaced part moves logits by whole
        # units). One row's NMSE against transformers reaches ~1e-5 on its own: Q4_K's group scales d * sc are
        # held in float16 (gguf_blocks.q4_k_decode), which the whole prompt's NMSE (~1.6e-6) averages out.
        engine = model.engine
        engine.prefill(PROMPT[:12], slot=0)
        for i in range(12, len(PROMPT)):
            step = engine.decode([PROMPT[i]], [0], [i])[0]
            assert_same_logits(step, got[i])
            assert nmse(step, expected_logits[i]) < 1e-4, i
    finally:
        model.close()


def test_q4_k_m_weights_stay_near_the_files_bytes(q4_k_m_file):
    """The QKV of a layer with a Q6_K v was one float32 matrix (4 bytes per weight); its parts keep their formats."""
    from perfx_core.bench import run_bench

    report = run_bench(str(q4_k_m_file), backend="numpy", prompt_tokens=8, gen_tokens=2, repeat=1)
    qkv = report["weight_bytes"]["qkv"]
    assert qkv["bytes_per_weight"] < 1.0, qkv


def test_a_files_blocks_next_to_another_format_are_not_decoded_on_the_host():
    """A Q4_K q|k kept as the file's blocks (a runtime that converts them on its device) next to an int8 v: the
    parts stay apart, in the model's concat_rows and again in for_runtime, and the blocks are never converted on
    the host (that was a full decode of q|k per such layer at load, thrown away)."""
    from perfx_core.weights import BlockWeight, Int8Weight, RowParts, concat_rows, for_runtime

    def refuse():
        raise AssertionError("the blocks were decoded on the host")

    blocks = [BlockWeight((np.zeros((4, 144), np.uint8),), "q4_k", 256, refuse) for _ in range(2)]
    v = Int8Weight(np.ones((4, 256), np.int8), np.ones((4, 8), np.float16))
    parts = concat_rows([*blocks, v])
    assert isinstance(parts, RowParts) and [type(p) for p in parts.parts] == [BlockWeight, Int8Weight]
    assert parts.parts[0].shape == (8, 256)
    kept = for_runtime(parts, frozenset({"q4_k"}), frozenset({"int8"}))
    assert isinstance(kept, RowParts) and [type(p) for p in kept.parts] == [BlockWeight, Int8Weight]
