"""Pytest helpers for backend and plugin authors: run the conformance kit inside your own test suite.

    from perfx_core.testing import assert_backend_conforms

    def test_my_backend_conforms():
        assert_backend_conforms("mybackend")

or one test per op:

    @pytest.mark.parametrize("backend, op", backend_conformance_cases("mybackend"))
    def test_op_conforms(backend, op):
        assert_backend_conforms(backend, ops=[op])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .conformance import ConformanceReport, check_backend
from .ops import FORMAT_OPS, OP_NAMES
from .plugins import get_registry


def assert_backend_conforms(
    name: str, device: int | str | None = None, ops: list[str] | None = None, seed: int = 0
) -> ConformanceReport:
    """Run check_backend on the current registry and fail the test with the formatted report if a case fails."""
    import pytest  # imported here so that importing perfx_core.testing outside pytest costs nothing

    report = check_backend(name, device, ops=ops, seed=seed)
    if not report.passed:
        pytest.fail(report.format(), pytrace=False)
    return report


def backend_conformance_cases(name: str, ops: list[str] | None = None) -> list[Any]:
    """``pytest.param(name, op)`` per op, with readable ids: ``pytest.mark.parametrize("backend, op", cases)``.
    The ops of a weight format (ops.FORMAT_OPS) are left out where nothing implements them for the backend."""
    import pytest

    optional = {op for names in FORMAT_OPS.values() for op in names}
    if not ops:
        registry = get_registry()
        implemented = {impl.op for impl in registry.ops if impl.backend in (name, "*")}
        ops = [op for op in OP_NAMES if op not in optional or op in implemented]
    return [pytest.param(name, op, id=f"{name}-{op}") for op in ops]


def isolated_plugins(monkeypatch: Any, disable: tuple[str, ...] = (), load: str | None = None) -> Iterator[Any]:
    """Body of a fixture testing plugins: every installed plugin loads except ``disable`` (``load=""``: only the
    built-in ones), the registry is rebuilt before the test and again after it from the real environment.

        @pytest.fixture
        def plugin_env(monkeypatch):
            yield from isolated_plugins(monkeypatch, disable=("a-plugin-that-outranks-mine",))
    """
    if load is None:
        monkeypatch.delenv("PERFX_LOAD_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("PERFX_LOAD_PLUGINS", load)
    if disable:
        monkeypatch.setenv("PERFX_DISABLE_PLUGINS", ",".join(disable))
    else:
        monkeypatch.delenv("PERFX_DISABLE_PLUGINS", raising=False)
    get_registry(refresh=True)
    yield monkeypatch
    monkeypatch.undo()
    get_registry(refresh=True)
