"""Copying a KV-cache prefix between slots (what the n choices of one server request share): the runtimes' own
copies and the host default agree with NumPy slicing, and a prompt continued from a copied prefix gives the
logits of one prefilled from scratch."""

from __future__ import annotations

import numpy as np
import pytest
from backend_availability import open_runtime_or_skip
from logits_tolerance import assert_same_logits

from perfx_core.backend import KVCacheSpec, Runtime
from perfx_core.errors import InvalidArgumentError


def _runtime(backend: str) -> Runtime:
    if backend == "opencl":
        pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")
    return open_runtime_or_skip(backend)  # no OpenCL device: a skip, unless CI requires OpenCL


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("backend", ["numpy", "opencl"])
@pytest.mark.parametrize("own_copy", [True, False], ids=["runtime", "host-default"])
def test_copy_kv_prefix_equals_slicing(backend, dtype, own_copy):
    rt = _runtime(backend)
    try:
        spec = KVCacheSpec(n_layers=3, n_slots=4, max_seq_len=16, n_kv_heads=2, head_dim=8, dtype=dtype)
        cache = rt.new_kv_cache(spec)
        rng = np.random.default_rng(1)
        k, v = (rng.standard_normal(spec.shape).astype(dtype) for _ in range(2))
        rt.kv_cache_from_numpy(cache, k, v)
        copy = rt.copy_kv_prefix if own_copy else lambda *a: Runtime.copy_kv_prefix(rt, *a)
        copy(cache, 1, 3, 5)
        for array in (k, v):
            array[:, 3, :, :5] = array[:, 1, :, :5]
        got_k, got_v = rt.kv_cache_to_numpy(cache)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    finally:
        rt.close()


def test_a_prompt_continued_from_a_copied_prefix_has_the_same_logits(smollm2):
    engine = smollm2.engine
    ids = smollm2.tokenizer.encode("The lighthouse keeper climbed the stairs at dusk", add_special=True)
    whole = engine.prefill(ids, slot=0)
    engine.copy_prefix(0, 1, len(ids) - 1)
    continued = engine.prefill(ids[-1:], slot=1, start=len(ids) - 1)
    assert_same_logits(continued, whole)
    with pytest.raises(InvalidArgumentError):
        engine.copy_prefix(1, 1, 3)
    with pytest.raises(InvalidArgumentError):
        engine.copy_prefix(0, 1, engine.max_seq_len + 1)
