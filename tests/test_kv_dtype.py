"""The KV-cache dtype option: perfx_core.load(kv_dtype=...), `--kv-dtype` of run, chat, bench and serve, and the
runtime's default."""

from __future__ import annotations

import pytest

import perfx_core
from perfx_core.bench import run_bench
from perfx_core.cli import build_parser
from perfx_core.errors import InvalidArgumentError


@pytest.mark.parametrize("kv_dtype, expected", [(None, "float32"), ("float16", "float16"), ("float32", "float32")])
def test_load_takes_the_kv_dtype_or_the_runtime_default(smollm2_path, kv_dtype, expected):
    model = perfx_core.load(smollm2_path, backend="numpy", context_length=32, kv_dtype=kv_dtype)
    try:
        assert model.engine.cache_spec.dtype == expected
        assert model.runtime.kv_cache_to_numpy(model.engine.cache)[0].dtype == expected
    finally:
        model.close()


def test_an_unknown_kv_dtype_is_a_clear_error(smollm2_path):
    with pytest.raises(InvalidArgumentError, match="kv_dtype must be 'float32' or 'float16'"):
        perfx_core.load(smollm2_path, backend="numpy", context_length=32, kv_dtype="bfloat16")


@pytest.mark.parametrize("command", [["run", "x"], ["chat"], ["bench"], ["serve"]])
def test_every_model_command_has_the_option(command):
    parser = build_parser()
    assert parser.parse_args([*command]).kv_dtype is None
    assert parser.parse_args([*command, "--kv-dtype", "float16"]).kv_dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--kv-dtype", "int8"])


def test_bench_reports_the_kv_dtype(smollm2_path):
    report = run_bench(str(smollm2_path), prompt_tokens=4, gen_tokens=2, repeat=1, kv_dtype="float16")
    assert report["kv_dtype"] == "float16"
