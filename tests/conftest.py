"""Shared fixtures: the real SmolLM2 model, loaded once per test session, and per-test user directories."""

from __future__ import annotations

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
