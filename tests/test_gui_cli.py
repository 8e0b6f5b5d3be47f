"""The parts of the desktop app that need no Qt: the ``gui`` subcommand's error and the dashboard's numbers."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

try:
    import perfx_gui  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gui"))

from perfx_gui import GuiUnavailableError
from perfx_gui.cli_commands import add_commands
from perfx_gui.facts import gguf_tensor_facts, is_out_of_memory, op_rows, parameter_count

from perfx_core.errors import BackendError, PerfxError


def test_gui_command_says_how_to_install_pyside6(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "PySide6" else real_find_spec(name, *a)
    )
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["gui", "--backend", "numpy"])
    with pytest.raises(GuiUnavailableError, match="pip install") as info:
        args.func(args)
    assert isinstance(info.value, PerfxError)


def test_parameter_count_matches_the_tensor_table(smollm2_path):
    from perfx_core.gguf_file import read_gguf
    from perfx_core.gguf_loader import load_llama_gguf

    config, _, _ = load_llama_gguf(smollm2_path)
    tensors = read_gguf(smollm2_path).tensors
    assert parameter_count(config) == sum(t.n_elements for t in tensors.values())
    types, op_bytes = gguf_tensor_facts(smollm2_path)
    assert types["Q4_1"] > 0 and set(op_bytes) == {"qkv_proj", "linear_add_rmsnorm", "gate_up_silu", "logits"}


def test_op_rows_per_token_and_bandwidth():
    profile = {"linear": {"seconds": 0.2, "calls": 20}, "rmsnorm": {"seconds": 0.05, "calls": 10}}
    rows = op_rows(profile, steps=10, op_weight_bytes={"linear": 10**8}, bandwidth_gbs=50.0)
    assert [r.op for r in rows] == ["linear", "rmsnorm"]
    assert rows[0].ms_per_token == pytest.approx(20.0) and rows[0].calls_per_token == 2
    assert rows[0].achieved_gbs == pytest.approx(5.0) and rows[0].bandwidth_fraction == pytest.approx(0.1)
    assert rows[1].bytes_per_token is None and rows[1].achieved_gbs is None
    assert op_rows(profile, 10, {"linear": 10**8}, None)[0].bandwidth_fraction is None


def test_out_of_memory_detection():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(BackendError("clCreateBuffer: CL_MEM_OBJECT_ALLOCATION_FAILURE (device memory)"))
    assert not is_out_of_memory(BackendError("no backend named 'x'"))
    assert not is_out_of_memory(ValueError("memory"))
