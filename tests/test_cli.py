"""The perfx command line, run as a user runs it: a real process on the real default model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def perfx(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("perfx")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "perfx_core"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, input=input, timeout=timeout, env=os.environ.copy()
    )


def test_perfx_script_is_installed():
    assert Path(sys.executable).with_name("perfx").exists() or shutil.which("perfx")


def test_run_streams_a_completion_of_the_default_model():
    result = perfx("run", "The capital of France is", "--temperature", "0", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr


def test_run_records_the_model_in_recent_models():
    perfx("run", "Hi", "-n", "1", "--quiet-stats")
    settings = json.loads((Path(os.environ["PERFX_CONFIG_DIR"]) / "settings.json").read_text())
    assert settings["recent_models"][0].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_chat_answers_and_exits_on_eof():
    result = perfx("chat", "-t", "0", "-n", "40", "--quiet-stats", input="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_backends_lists_numpy_with_device_and_ops():
    result = perfx("backends", "--ops")
    assert result.returncode == 0, result.stderr
    assert "numpy" in result.stdout and "device 0: CPU" in result.stdout
    assert "attention_decode" in result.stdout


def test_check_backend_numpy_passes():
    result = perfx("check-backend", "numpy", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True


def test_bench_prints_json_with_speeds_and_memory():
    result = perfx("bench", "--prompt-tokens", "32", "--gen-tokens", "8", "--repeat", "1", "--profile")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in (
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "time_to_first_token_s",
        "peak_host_bytes",
        "backend_bytes",
    ):
        assert report[key] > 0, key
    assert "attention_decode" in report["runs"][0]["decode_op_profile_ms_per_token"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "x", "--model", "/nonexistent/model.gguf"), "does not exist"),
        (("run", "x", "--backend", "nope"), "no backend named 'nope'"),
        (("run", "x", "--temperature", "-1"), "temperature"),
        (("run", "x", "--device", "7"), "one device"),
        (("bench", "--prompt-tokens", "0"), "prompt_tokens"),
    ],
)
def test_user_errors_are_one_clear_line(args, message):
    result = perfx(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("perfx: error:") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    result = perfx("run", "x", "--model", str(bad))
    assert result.returncode == 2 and "not a GGUF file" in result.stderr
