"""Every model family on the OpenCL backend (PoCL here), past its sliding window: the attention kernels' windows,
soft-capping and score scales, and the families' other ops, against transformers' own forward pass on the same
tiny random checkpoints (tests/tiny_families.py), and greedy decoding against the NumPy backend's."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_families as tf
from opencl_support import opencl_usable

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")
pytest.importorskip("transformers")

pytestmark = opencl_usable

IDS = np.random.default_rng(0).integers(3, tf.VOCAB, 40).tolist()  # 40 > 32 rows: the long-prompt kernels too


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tf.Checkpoints:
    return tf.Checkpoints(tmp_path_factory.mktemp("opencl-families"))


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    generation = model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)
    generation.run()
    return list(generation.token_ids)


@pytest.mark.parametrize("family", tf.FAMILIES)
def test_family_on_opencl_matches_transformers(checkpoints, family):
    """Logits and greedy decoding; and every family op runs on the device: its decode steps are recorded as
    graphs, which a step with host work in it (an op through the host) cannot be."""
    path, reference = checkpoints.source(family, "hf")
    expected = tf.hf_logits(reference, IDS)
    with tf.loaded(path, backend="opencl") as model:
        ours = model.logits(IDS)
        generated = _greedy(model, IDS[:12], 8)  # decode steps past the window of 8
        assert any(key[0] != "prefill" for key in model.engine._graphs), f"{family}: no decode step was recorded"
    error = tf.nmse(ours, expected)
    assert error < 1e-5, f"{family} on OpenCL: NMSE {error:.2e} against transformers"
    with tf.loaded(path) as model:
        assert generated == _greedy(model, IDS[:12], 8)
