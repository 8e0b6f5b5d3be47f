"""Shared fixtures: the real SmolLM2 model, loaded once per test session, and per-test user directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import perfx_core
from perfx_core.default_model import bundled_model_path


@pytest.fixture(autouse=True)
def _user_dirs(tmp_path, monkeypatch):
    """Keep settings and caches written by tests out of the real user directories."""
    monkeypatch.setenv("PERFX_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("PERFX_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def smollm2_path():
    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    model = perfx_core.load(smollm2_path, backend="numpy", context_length=1024, n_slots=4)
    yield model
    model.close()


@pytest.fixture
def registry():
    """The process-wide registry, with the OpenCL plugin registered even when its entry point is not installed
    (the OpenCL test modules)."""
    import perfx_opencl.plugin

    from perfx_core.plugins import get_registry, register_plugin

    reg = get_registry()
    if "opencl" not in reg.backends:
        reg = register_plugin(perfx_opencl.plugin, "opencl")
    return reg


@pytest.fixture(scope="session")
def grammar_server():
    """One `perfx serve` (4 slots) shared by the structured-output and tool-calling tests: a start is seconds."""
    from test_serving import serve

    yield from serve("--max-running", "4")


# The long modules (OpenCL on PoCL, the real Gemma 3 file against transformers, lm-evaluation-harness against a
# server) run when named on the command line or with PERFX_LONG_TESTS=1; CI runs them as a step of their own, so
# the default run stays within minutes.
LONG_MODULES = (
    "test_opencl.py",  # the OpenCL modules: PoCL compiles every kernel variant (three modules, two workers)
    "test_opencl_graphs.py",
    "test_opencl_kernels.py",
    "test_opencl_families.py",
    "test_opencl_int8.py",
    "test_gemma3_gguf.py",
    "test_lm_eval.py",
    "test_gui_xcb.py",
    "test_ray_serve.py",  # perfx serve --ray: SmolLM2 replicas on a local Ray cluster (~3.5 min on 2 cores)
    "test_readme.py",  # every README snippet, each a process loading the model
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PERFX_LONG_TESTS") == "1":
        return
    named = {Path(str(arg).split("::")[0]).name for arg in config.args}
    long = [item for item in items if item.path.name in LONG_MODULES and item.path.name not in named]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if item not in long]


def pytest_report_header(config):
    if os.environ.get("PERFX_LONG_TESTS") != "1":
        return f"long modules left out unless named or PERFX_LONG_TESTS=1: {', '.join(LONG_MODULES)}"
    return None
