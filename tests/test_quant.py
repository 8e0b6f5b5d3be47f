"""Int4 quantization: RTN/AWQ math, `perfx quantize` round trips on SmolLM2, failure safety, AWQ against RTN."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import write_tiny_llama_gguf

import perfx_core
from perfx_core.config import LlamaConfig
from perfx_core.errors import InvalidArgumentError, PerfxError
from perfx_core.formats.hf_export import gguf_to_hf
from perfx_core.formats.perfx_format import PerfxWriter
from perfx_core.quant import quantize
from perfx_core.quant.awq import awq_block, quantize_groups
from perfx_core.quant.calibration import HELDOUT_TEXT, read_text, strip_header
from perfx_core.quant.cli_commands import add_commands
from perfx_core.quant.forward import block_forward
from perfx_core.rope import rope_cos_sin
from perfx_core.weights import quantize_rtn


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="perfx")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


@pytest.fixture(scope="module")
def smol_fp32(smollm2_path, tmp_path_factory):
    """SmolLM2-135M dequantized from the bundled GGUF: the full-precision reference, as an fp32 HF directory."""
    return gguf_to_hf(smollm2_path, tmp_path_factory.mktemp("smol") / "fp32", layers_per_shard=8)


@pytest.fixture(scope="module")
def heldout_ids(smollm2):
    return smollm2.tokenizer.encode(strip_header(read_text(HELDOUT_TEXT)), add_special=True)


# -- math ----------------------------------------------------------------------------------------------------


def test_quantize_groups_is_quantize_rtn():
    w = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    w[3, :64] = np.abs(w[3, :64])  # a group without negative values
    q, scale, zero = quantize_groups(w, 64)
    ref = quantize_rtn(w, 64)
    from perfx_core.weights import int4_from_scale_zero

    got = int4_from_scale_zero(q, scale, zero, 64)
    np.testing.assert_array_equal(got.packed, ref.packed)
    np.testing.assert_array_equal(got.scale, ref.scale)
    np.testing.assert_array_equal(got.bias, ref.bias)


def test_awq_scaling_keeps_the_float_block_and_lowers_its_error():
    config = LlamaConfig(vocab_size=32, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                         norm_eps=1e-5, rope_theta=10000.0, context_length=64)  # fmt: skip
    rng = np.random.default_rng(1)
    shapes = {
        "wq": (64, 64),
        "wk": (32, 64),
        "wv": (32, 64),
        "wo": (64, 64),
        "w_gate": (128, 64),
        "w_up": (128, 64),
        "w_down": (64, 128),
    }
    w = {n: (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for n, s in shapes.items()}
    w["attn_norm"] = (1 + 0.2 * rng.standard_normal(64)).astype(np.float32)
    w["ffn_norm"] = (1 + 0.2 * rng.standard_normal(64)).astype(np.float32)
    h = rng.standard_normal((3, 16, 64)).astype(np.float32)
    h[..., 5] *= 20  # an outlier channel, the case AWQ is for
    cos, sin = rope_cos_sin(config, 16)
    before, inputs = block_forward(h, w, config, cos, sin)
    scaled = dict(w)
    quantized, report = awq_block(scaled, inputs, config, {n: 32 for n in shapes}, np.arange(48))
    after, _ = block_forward(h, scaled, config, cos, sin, record=False)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4)  # scales were folded, not added
    for group in report.rtn_error:
        assert report.awq_error[group] <= report.rtn_error[group]
    assert report.awq_error["qkv"] < 0.9 * report.rtn_error["qkv"]
    assert all(q.group_size == 32 for q in quantized.values())


# -- round trips -------------------------------------------------------------------------------------------


def test_cli_quantize_smollm2_hf_directory_round_trip(smol_fp32, tmp_path, heldout_ids):
    from safetensors import safe_open

    out = tmp_path / "smol-rtn"
    assert run_cli("quantize", str(smol_fp32), "-o", str(out), "--method", "rtn", "--quiet") == 0
    meta = json.loads((out / "perfx.json").read_text())
    assert meta["format"] == "perfx" and meta["perfx_version"] == perfx_core.__version__
    q = meta["quantization"]
    assert (q["method"], q["bits"], q["group_size"], q["calibration"]) == ("rtn", 4, 128, None)
    assert q["group_sizes"]["w_down"] == 128 and q["group_sizes"]["wq"] == 64  # 576 columns: 128 does not divide
    assert (out / "tokenizer.json").is_file() and meta["tokenizer"]["kind"] == "tokenizer.json"
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.get_tensor("layers.0.wq.qweight").dtype == np.uint8

    ref = perfx_core.load(smol_fp32, context_length=64)
    model = perfx_core.load(out, context_length=64)
    w = model.engine  # the loader handed out views of the mapped file
    from perfx_core.formats.perfx_format import load_perfx_directory

    _, weights, _ = load_perfx_directory(out)
    assert not weights.layers[0].wq.packed.flags.writeable and not weights.token_embedding.data.flags.writeable
    assert w.config == ref.config
    ids = heldout_ids[:32]
    a, b = model.logits(ids), ref.logits(ids)
    # Exactly the int4 values weights.quantize_rtn gives (only the embedding differs: fp16 in perfx's format) ...
    same = perfx_core.load(smol_fp32, context_length=64, quantize="rtn").logits(ids)
    assert nmse(a, same) < 1e-5
    # ... and within int4 error of the fp32 reference (SmolLM2-135M is sensitive: RTN alone gives NMSE ~0.5;
    # a wrong layout or nibble order gives NMSE > 1 and chance-level agreement).
    assert nmse(a, b) < 0.8
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.6


def test_quantize_a_gguf_keeps_its_tokenizer(tmp_path):
    tiny = write_tiny_llama_gguf(
        tmp_path / "tiny.gguf", tensor_type="Q4_K", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512
    )
    quantize(tiny.path, tmp_path / "out", method="awq", group_size=64, calib=None, n_samples=2, seqlen=32)
    meta = json.loads((tmp_path / "out" / "perfx.json").read_text())
    assert meta["tokenizer"]["kind"] == "gguf-metadata" and meta["quantization"]["calibration"]["samples"] >= 1
    src = perfx_core.load(tiny.path, context_length=64)
    out = perfx_core.load(tmp_path / "out", context_length=64)
    text = "hello the cat sat on the hat"
    assert out.tokenizer.encode(text, add_special=True) == src.tokenizer.encode(text, add_special=True)
    assert out.chat_template == src.chat_template
    ids = src.tokenizer.encode(text)
    assert nmse(out.logits(ids), src.logits(ids)) < 0.05


# -- failure safety ------------------------------------------------------------------------------------------


def test_interrupted_quantize_leaves_no_output(smol_fp32, tmp_path, monkeypatch):
    real = PerfxWriter.write_layer

    def interrupt(self, i, *args):
        if i == 2:
            raise KeyboardInterrupt
        return real(self, i, *args)

    monkeypatch.setattr(PerfxWriter, "write_layer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        quantize(smol_fp32, tmp_path / "out", method="rtn")
    assert list(tmp_path.iterdir()) == []  # neither OUT nor the temporary directory beside it
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "perfx.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        quantize(smol_fp32, tmp_path / "keep", method="rtn", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["keep"] and (tmp_path / "keep" / "perfx.json").read_text() == "{}"
    with pytest.raises(InvalidArgumentError, match="exists"):
        quantize(smol_fp32, tmp_path / "keep", method="rtn")


def test_unreadable_calibration_file_is_a_perfx_error(smol_fp32, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (tmp_path / "short.txt").write_text("Too short.")
    for bad in ("missing.txt", "latin1.txt", "short.txt", "."):
        with pytest.raises(PerfxError):
            quantize(smol_fp32, tmp_path / "out", method="awq", calib=tmp_path / bad)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidArgumentError):
        quantize(smol_fp32, tmp_path / "out", method="gptq")
    with pytest.raises(InvalidArgumentError):
        quantize(smol_fp32, tmp_path / "out", group_size=96)


# -- AWQ against RTN -------------------------------------------------------------------------------------------


def test_awq_beats_rtn_on_smollm2_blocks(smollm2_path, tmp_path, heldout_ids):
    """The first 3 blocks of SmolLM2 (real weights and activations): AWQ g128 tracks the float model better.

    A truncated model's perplexity means nothing, so this measures the error of its logits on held-out text;
    benchmarks/awq_vs_rtn.py (and the PERFX_FULL_AWQ test below) measure perplexity on the whole model.
    """
    fp32 = gguf_to_hf(smollm2_path, tmp_path / "fp32", n_layers=3)
    quantize(fp32, tmp_path / "rtn", method="rtn")
    quantize(fp32, tmp_path / "awq", method="awq", n_samples=2, seqlen=128)
    ids = heldout_ids[:96]
    ref = perfx_core.load(fp32, context_length=96).logits(ids)
    err = {m: nmse(perfx_core.load(tmp_path / m, context_length=96).logits(ids), ref) for m in ("rtn", "awq")}
    print(f"logit NMSE against fp32: RTN {err['rtn']:.4g}, AWQ {err['awq']:.4g}")
    assert err["awq"] < 0.7 * err["rtn"]  # measured: 0.45x


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PERFX_FULL_AWQ"), reason="minutes on 2 cores: set PERFX_FULL_AWQ=1")
def test_awq_closes_the_perplexity_gap_on_smollm2(smol_fp32, tmp_path):
    from perfx_core.quant.eval import perplexity

    quantize(smol_fp32, tmp_path / "rtn", method="rtn")
    quantize(smol_fp32, tmp_path / "awq", method="awq", n_samples=16, seqlen=256)
    text = strip_header(read_text(HELDOUT_TEXT))
    ppl = {m: perplexity(perfx_core.load(d, context_length=512), text, ctx=512, stride=256).ppl
           for m, d in (("fp32", smol_fp32), ("rtn", tmp_path / "rtn"), ("awq", tmp_path / "awq"))}  # fmt: skip
    closed = (ppl["rtn"] - ppl["awq"]) / (ppl["rtn"] - ppl["fp32"])
    print(
        f"ppl fp32 {ppl['fp32']:.3f}, RTN {ppl['rtn']:.3f}, AWQ {ppl['awq']:.3f}: {100 * closed:.0f}% of the gap closed"
    )
    assert ppl["rtn"] > ppl["fp32"] and closed >= 0.4


def test_force_never_replaces_the_source_or_a_foreign_directory(tmp_path):
    from perfx_core.quant import quantize

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="is \\(or contains\\) the source"):
        quantize(src, src, method="rtn", overwrite=True)
    with pytest.raises(InvalidArgumentError, match="is \\(or contains\\) the source"):
        quantize(src, tmp_path, method="rtn", overwrite=True)
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(InvalidArgumentError, match="not a perfx model directory"):
        quantize(src, foreign, method="rtn", overwrite=True)
    assert (foreign / "cat.jpg").exists() and (src / "config.json").exists()


# -- the output directory: atomic, durable, normal permissions, no leftovers ----------------------------------


def perfx_command() -> list[str]:
    exe = Path(sys.executable).with_name("perfx")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "perfx_core"]


def tiny_source(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir(exist_ok=True)
    return write_tiny_llama_gguf(
        tmp_path / "src" / "tiny.gguf", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512
    ).path


def start_quantize(src: Path, out: Path) -> subprocess.Popen:
    """`perfx quantize` in its own process, returned once it has written two blocks into its partial directory."""
    proc = subprocess.Popen(
        [*perfx_command(), "quantize", str(src), "-o", str(out), "--method", "rtn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in proc.stderr:
        if line.startswith("block 2/"):
            return proc
    proc.wait()
    raise AssertionError(f"perfx quantize ended (exit {proc.returncode}) before its second block")


def test_killed_quantize_leaves_no_output_and_the_next_run_removes_its_partial(smol_fp32, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    proc = start_quantize(smol_fp32, out)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    left = list(work.iterdir())
    assert not out.exists() and len(left) == 1 and left[0].name.startswith(".out.partial-")
    quantize(tiny_source(tmp_path), out, method="rtn")
    assert [p.name for p in work.iterdir()] == ["out"]


def test_the_next_run_spares_a_partial_directory_in_use(smol_fp32, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    young, old = work / ".out.partial-young", work / ".out.partial-old"  # empty: a run may be creating them
    young.mkdir()
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    proc = start_quantize(smol_fp32, out)
    try:
        proc.send_signal(signal.SIGSTOP)  # alive, mid-run
        (live,) = [p for p in work.iterdir() if p not in (young, old)]
        quantize(tiny_source(tmp_path), out, method="rtn")
        assert live.is_dir() and (live / "model.safetensors").is_file() and young.is_dir() and not old.exists()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    quantize(tiny_source(tmp_path), out, method="rtn", overwrite=True)
    assert sorted(p.name for p in work.iterdir()) == [".out.partial-young", "out"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_has_the_permissions_of_a_plain_mkdir(tmp_path, umask):
    src = tiny_source(tmp_path)
    previous = os.umask(umask)
    try:
        quantize(src, tmp_path / "out", method="rtn")
        quantize(src, tmp_path / "out", method="rtn", overwrite=True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    files = list((tmp_path / "out").iterdir())
    assert len(files) == 3 and all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask for f in files)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_quantize_force_syncs_everything_then_swaps_without_a_missing_moment(tmp_path):
    src, out, trace = tiny_source(tmp_path), tmp_path / "out", tmp_path / "trace"
    quantize(src, out, method="rtn")
    syscalls = "trace=fsync,fdatasync,rename,renameat,renameat2"
    command = [*perfx_command(), "quantize", str(src), "-o", str(out), "--method", "rtn", "--force", "-q"]
    result = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-o", str(trace), "-e", syscalls, *command], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    calls = trace.read_text().splitlines()
    moves = [i for i, c in enumerate(calls) if "rename" in c and f'"{out}"' in c]
    assert moves and all("RENAME_EXCHANGE" in calls[i] for i in moves), "\n".join(calls[i] for i in moves)
    partial = re.search(r'"([^"]*/\.out\.partial-[^"]*)"', calls[moves[0]]).group(1)
    synced = {m.group(1) for c in calls[: moves[0]] for m in [re.search(r"fsync\(\d+<([^>]*)>", c)] if m}
    expected = {partial} | {f"{partial}/{f.name}" for f in out.iterdir()}
    assert expected <= synced, sorted(expected - synced)
    assert any("fsync(" in c and f"<{tmp_path}>" in c for c in calls[moves[0] :])  # the rename itself, durable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "trace"]


WATCH_OUTPUT = """
import os, sys
target, stop = sys.argv[1:]
print("watching", flush=True)
checks = missing = 0
while not os.path.exists(stop):
    checks += 1
    missing += not os.path.exists(target)
print(checks, missing)
"""


def test_force_never_leaves_a_moment_without_the_output(tmp_path):
    src, out, stop = tiny_source(tmp_path), tmp_path / "out", tmp_path / "stop"
    quantize(src, out, method="rtn")
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCH_OUTPUT, str(out / "perfx.json"), str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout.readline() == "watching\n"
        for _ in range(20):
            quantize(src, out, method="rtn", overwrite=True)
    finally:
        stop.touch()
        checks, missing = map(int, watcher.communicate(timeout=60)[0].split())
    assert checks > 1000 and missing == 0
