"""The OpenCL backends (``opencl``, ``opencl-adreno``): conformance, SmolLM2 end to end against NumPy, errors, memory.

Runs wherever pyopencl finds an OpenCL device that can build kernels (PoCL on a CPU is enough); skips with
the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest
from scheduler_check import check_overlapped_output

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")

import perfx_opencl.plugin  # noqa: E402
from perfx_opencl.backend import OpenCLBackend  # noqa: E402
from perfx_opencl.runtime import KernelBuildError  # noqa: E402

import perfx_core  # noqa: E402
from perfx_core.errors import BackendError, BackendUnavailableError  # noqa: E402
from perfx_core.plugins import get_registry, register_plugin  # noqa: E402
from perfx_core.testing import assert_backend_conforms  # noqa: E402

PROMPT = "The capital of France is"


def _why_unusable() -> str | None:
    try:
        OpenCLBackend().open().close()
    except BackendUnavailableError as exc:
        return str(exc)
    except BackendError as exc:
        return f"no OpenCL device could build a kernel: {exc}"
    return None


_REASON = _why_unusable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"OpenCL unusable here: {_REASON}")


@pytest.fixture
def registry():
    """The process-wide registry, with the OpenCL plugin registered even when its entry point is not installed."""
    reg = get_registry()
    if "opencl" not in reg.backends:
        reg = register_plugin(perfx_opencl.plugin, "opencl")
    return reg


def _entry_point_installed() -> bool:
    return any(ep.name == "opencl" for ep in importlib.metadata.entry_points(group="perfx"))


@pytest.mark.skipif(not _entry_point_installed(), reason="perfx is not pip-installed with the opencl entry point")
def test_perfx_backends_lists_both_opencl_backends(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "perfx_core", "backends", "--ops"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\nopencl  (" in out and "\nopencl-adreno  (" in out
    assert "device 0:" in out.split("\nopencl  (")[1]
    assert "opencl:int4_gemv" in out


@pytest.mark.parametrize("backend", ["opencl", "opencl-adreno"])
def test_backend_conforms(registry, backend):
    assert_backend_conforms(backend)


def test_adreno_backend_can_be_forced_on_any_device(registry):
    rt = registry.open_runtime("opencl-adreno")
    try:
        assert rt.backend_name == "opencl-adreno" and rt.variant == "adreno"
        assert rt.use_images == bool(rt.cl_device.image_support)
    finally:
        rt.close()


def test_device_by_name_and_index(registry):
    backend = registry.get_backend("opencl")
    devices = backend.devices()
    assert devices and all(d.kind in ("cpu", "gpu") and d.memory_bytes > 0 for d in devices)
    rt = backend.open(devices[0].name[:8])
    assert rt.device.name == devices[0].name
    rt.close()
    with pytest.raises(BackendError, match="devices 0.."):
        backend.open(len(devices) + 5)
    with pytest.raises(BackendError, match="no opencl device matches"):
        backend.open("no-such-device-name")


def test_kernel_build_failure_raises_backend_error_with_log(registry):
    rt = registry.open_runtime("opencl")
    try:
        with pytest.raises(BackendError) as info:
            rt.build("__kernel void broken(__global float* x) { x[0] = undeclared_name; }", label="broken.cl")
        assert isinstance(info.value, KernelBuildError)
        assert "broken.cl" in str(info.value) and "undeclared_name" in info.value.log
    finally:
        rt.close()


def test_built_programs_are_cached_on_disk_and_a_bad_entry_is_rebuilt(registry, tmp_path, monkeypatch):
    from perfx_opencl import program_cache

    source = f"__kernel void twice(__global float* x) {{ x[get_global_id(0)] *= 2.0f; }} // {tmp_path}\n"
    rt = registry.open_runtime("opencl")
    try:
        path = program_cache.entry_path(rt, source, ("-DX=1",))
        assert not path.exists() and str(path).startswith(str(tmp_path))  # conftest: PERFX_CACHE_DIR in tmp_path
        rt.build(source, ("-DX=1",), label="twice.cl")
        assert path.stat().st_size > 0 and rt.load_stats["programs_built"] >= 1

        def run_from_a_new_process_state(expect_cached: bool) -> None:
            rt._state.programs.clear()  # as a new process would start
            hits = rt.load_stats["programs_from_cache"]
            program = rt.build(source, ("-DX=1",), label="twice.cl")
            assert rt.load_stats["programs_from_cache"] == hits + expect_cached
            x = rt.from_numpy(np.arange(4, dtype=np.float32))
            program.twice(rt.queue, (4,), None, x.buffer)
            assert rt.to_numpy(x).tolist() == [0.0, 2.0, 4.0, 6.0]

        run_from_a_new_process_state(expect_cached=True)
        path.write_bytes(b"not a program binary")
        run_from_a_new_process_state(expect_cached=False)  # refused, rebuilt from source and stored again
        assert path.read_bytes() != b"not a program binary"
        monkeypatch.setenv("PERFX_OPENCL_PROGRAM_CACHE", "0")
        path.unlink()
        run_from_a_new_process_state(expect_cached=False)
        assert not path.exists()
    finally:
        rt.close()


def test_int4_weights_are_repacked_on_the_device_into_the_chunk_major_layout(registry):
    from perfx_core.weights import Int4Weight

    rng = np.random.default_rng(0)
    m, k, group = 5, 128, 64
    weight = Int4Weight(
        rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
        rng.standard_normal((m, k // group)).astype(np.float16),
        rng.standard_normal((m, k // group)).astype(np.float32),
        group,
    )
    rt = registry.open_runtime("opencl")
    try:
        handle = rt.prepare_weight(weight)
        chunks = weight.packed.reshape(m, k // 32, 16).transpose(1, 0, 2)
        np.testing.assert_array_equal(rt.to_numpy(handle.packed), chunks)
        np.testing.assert_array_equal(rt.to_numpy(handle.scale), weight.scale.T)
        np.testing.assert_array_equal(rt.to_numpy(handle.bias), weight.bias.T)
        assert rt.load_stats["weights_s"] > 0
    finally:
        rt.close()


def test_views_share_storage_and_are_bounds_checked(registry):
    rt = registry.open_runtime("opencl")
    try:
        base = rt.from_numpy(np.arange(12, dtype=np.float32))
        view = rt.view(base, 5, (2, 3))
        np.testing.assert_array_equal(rt.to_numpy(view), np.arange(5, 11, dtype=np.float32).reshape(2, 3))
        rt.write(view, np.zeros(6, np.float32))
        assert rt.to_numpy(base).tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 11]
        with pytest.raises(BackendError, match="outside"):
            rt.view(base, 10, (3,))
    finally:
        rt.close()


def test_allocated_bytes_follow_the_model(registry, smollm2_path):
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        start = rt.allocated_bytes
        model = LlamaModel(config, weights, rt, max_seq_len=64, prefill_chunk=16)
        loaded = rt.allocated_bytes
        assert loaded - start > 50 * 2**20  # SmolLM2-135M in int4 is ~100 MB on the device
        assert rt.peak_allocated_bytes >= loaded
        model.prefill([1, 2, 3])
        del model
        gc.collect()
        assert rt.allocated_bytes - start < 2**20  # only the runtime's small index and scratch buffers remain
    finally:
        rt.close()


def test_kv_cache_is_float16_by_default_on_gpus(registry, smollm2_path):
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        assert rt.default_kv_dtype == ("float16" if rt.device.kind == "gpu" else "float32")
        rt.device = dataclasses.replace(rt.device, kind="gpu")  # as a GPU reports itself
        assert LlamaModel(config, weights, rt, max_seq_len=32, prefill_chunk=16).cache.k.dtype == np.float16
        chosen = LlamaModel(config, weights, rt, max_seq_len=32, prefill_chunk=16, kv_dtype="float32")
        assert chosen.cache.k.dtype == np.float32  # float32 stays selectable
    finally:
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_smollm2_greedy_tokens_and_logits_match_numpy(registry, smollm2, kv_dtype):
    """Against the float32 NumPy reference, with either KV-cache dtype (float16 is the default on GPUs)."""
    model = perfx_core.load(backend="opencl", context_length=256, kv_dtype=kv_dtype)
    try:
        assert model.backend == "opencl" and model.engine.cache_spec.dtype == kv_dtype
        ours = model.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True)
        ours.run()
        ref = smollm2.generate(PROMPT, max_tokens=64, temperature=0, ignore_eos=True)
        ref.run()
        assert ours.token_ids == ref.token_ids, (ours.text, ref.text)
        assert "Paris" in ours.text

        ids = model.tokenizer.encode(PROMPT, add_special=True) + ref.token_ids[:27]  # ~32 tokens
        got, want = model.logits(ids), smollm2.logits(ids)
        nmse = float(((got - want) ** 2).sum() / (want**2).sum())
        assert nmse < 1e-4, nmse
    finally:
        model.close()


# -- perfx tune ----------------------------------------------------------------------------------------------


def test_perfx_tune_caches_per_device_and_the_runtime_uses_it(registry, tmp_path, monkeypatch):
    """`perfx tune` on a real (tiny, Q4_0) GGUF: the cache file holds a shape per matmul and token count, a
    fresh runtime launches with it, and a stale, corrupt or foreign file is ignored, never trusted."""
    import json

    from perfx_opencl import ops, tuning
    from tiny_gguf import write_tiny_llama_gguf

    from perfx_core.cli import main
    from perfx_core.gguf_file import read_gguf
    from perfx_core.gguf_loader import read_llama_config

    monkeypatch.setenv("PERFX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, tensor_type="Q4_0", dim=128, ffn_dim=256, seed=3)
    vocab = read_llama_config(read_gguf(path)).vocab_size
    assert main(["tune", "-b", "opencl", "-m", str(path), "--quick"]) == 0
    rt = registry.open_runtime("opencl")
    try:
        path = tuning.cache_path(rt)
        data = json.loads(path.read_text())
        assert data["device"] == rt.device.name
        assert data["kernel_hash"] == tuning.kernel_hash()
        # qkv (4 heads x 32 + 2 x 2 kv heads x 32 = 256 rows), wo, gate|up (SiLU), down, logits; n = 1..16
        assert {key.rsplit(":", 1)[0] for key in data["gemv"]} == {
            "gemv:256x128",
            "gemv:128x128",
            "silu:256x128",
            "gemv:128x256",
            f"gemv:{vocab}x128",
        }
        assert len(data["gemv"]) == 5 * len(tuning.SMALL_NS)
        chosen = data["gemv"]["silu:256x128:nt4"]
        assert ops.gemv_tuning(rt, True, 256, 128, 4) == chosen  # a new runtime reads the file

        for bad in ('{"format": 1, "kernel_hash": "0", "gemv": {}}', "{not json", '{"format": 1, "gemv": 3}'):
            path.write_text(bad)
            ops.clear_plans(rt)
            defaults = {**ops.GEMV_TUNING, "CR": 1, "QX": int(rt.native_int_dot)}
            assert ops.gemv_tuning(rt, True, 256, 128, 4) == defaults
        # Shapes that would crash or hang a launch:
        for impossible in ({"RW": 0}, {"CR": 0}, {"UC": 0}, {"XS": 2}, {"QX": 2}, {"KS": "8"}):
            data["gemv"]["silu:256x128:nt4"] = {**chosen, **impossible}
            path.write_text(json.dumps(data))
            ops.clear_plans(rt)
            assert "silu:256x128:nt4" not in tuning.load(rt) and "silu:256x128:nt2" in tuning.load(rt)
    finally:
        rt.close()


def test_perfx_tune_refuses_a_backend_without_kernels(capsys):
    from perfx_core.cli import main

    assert main(["tune", "-b", "numpy", "--quick"]) == 2
    assert "has nothing to tune" in capsys.readouterr().err


# -- graphs --------------------------------------------------------------------------------------------------


def _native_replays(native: bool, monkeypatch) -> None:
    """Replays queued from the native thread (native_replay.py) or from Python; skips where none can be built."""
    from perfx_opencl import native_replay

    monkeypatch.setenv("PERFX_OPENCL_NATIVE_REPLAY", "1" if native else "0")
    if native and native_replay.replayer() is None:
        pytest.skip("no native replayer here (a C compiler and the OpenCL library are needed)")


@pytest.mark.parametrize("native", [True, False], ids=["native-replay", "python-replay"])
def test_recorded_decode_steps_replay_exactly(registry, smollm2_path, monkeypatch, native):
    """Decode with graphs (recorded steps replayed) gives the logits of running every op, over batch sizes
    1 and 3 and across attention partition boundaries (a new recording each time the signature changes).
    Prompts of 3-5 tokens are recorded too, padded to one 16-token graph: the padding rows' cache entries
    are overwritten before any step reads them, so every later logit is unchanged. Replays are queued from
    the native thread or from Python: the same logits either way."""
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    _native_replays(native, monkeypatch)
    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=160, prefill_chunk=16)
        prompt = [1, 504, 3458, 282, 4649, 314]

        def run(graphs: str) -> list[np.ndarray]:
            monkeypatch.setenv("PERFX_OPENCL_GRAPHS", graphs)
            model._graphs.clear()
            out, tokens = [], [7, 8, 9]
            for slot in range(3):
                out.append(model.prefill(prompt[: 3 + slot], slot=slot))
            positions = [3, 4, 5]  # each slot's next position: a sequence writes every position in order
            for step in range(70):  # slot 0 reaches position 72: across the 64-position partition boundary
                batch = 1 if step % 2 else 3
                logits = model.decode(tokens[:batch], list(range(batch)), positions[:batch])
                positions = [p + 1 for p in positions[:batch]] + positions[batch:]
                tokens = [int(t) for t in np.argmax(logits, axis=1)] + tokens[len(logits) :]
                out.append(logits)
            return out

        plain = run("0")
        assert not model._graphs and model.recordings == 0
        replays = []
        replay = rt.replay
        monkeypatch.setattr(rt, "replay", lambda graph, inputs: (replays.append(graph), replay(graph, inputs)))
        replayed = run("1")
        assert len(replays) == 2 + 70 - 4  # every prompt and step but the first of its kind
        assert {key[0] for key in model._graphs} == {"prefill", 1, 3} and len(model._graphs) == 5  # + 2 x 2 decode
        assert model.recordings == 5  # what a server's /metrics shows as perfx_engine_step_recordings
        assert all((graph.native is not None) == native for graph in model._graphs.values())
        for a, b in zip(plain, replayed, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        rt.close()


def test_a_native_replay_is_joined_before_the_queue_is_used_and_reports_a_failed_launch(registry, monkeypatch):
    """A graph replayed from the native thread: reading its output waits for every launch (64 in-place residual
    additions, so a read ahead of any of them would see less); a launch the driver refuses (a work-group larger
    than any device allows) surfaces as a BackendError naming the kernel at the next use of the queue, and the
    runtime keeps working after it."""
    import dataclasses

    _native_replays(True, monkeypatch)
    rt = registry.open_runtime("opencl")
    try:
        ones, weight = rt.from_numpy(np.ones((1, 256), np.float32)), rt.from_numpy(np.ones(256, np.float32))
        residual, out = rt.from_numpy(np.zeros((1, 256), np.float32)), rt.empty((1, 256))
        rt.begin_capture(("ids",))
        for _ in range(64):
            rt.ops.add_rmsnorm(ones, residual, weight, 1e-6, out)  # residual += 1 (recording runs them too)
        graph = rt.end_capture()
        assert graph is not None and graph.native is not None and len(graph.launches) == 64
        for replays in (1, 2):
            rt.replay(graph, {})
            np.testing.assert_array_equal(rt.to_numpy(residual), np.full((1, 256), 64.0 * (1 + replays)))

        kernel, _, _, name = graph.launches[0]
        refused = ((kernel, (1 << 24,), (1 << 24,), name),)
        bad = dataclasses.replace(graph, launches=refused, native=graph.native.native.plan(refused))
        rt.replay(bad, {})  # returns at once: the thread finds out
        with pytest.raises(BackendError, match="add_rmsnorm"):
            rt.to_numpy(residual)
        rt.replay(graph, {})
        np.testing.assert_array_equal(rt.to_numpy(residual), np.full((1, 256), 256.0))
    finally:
        rt.close()


def test_a_native_replay_outlives_its_dropped_graph_and_is_joined_by_another_runtime(registry, monkeypatch):
    """The model may drop a graph (closing, or evicting it) while its replay's thread still queues it: the
    replay keeps the graph's kernels and buffers alive until joined. A second runtime on the same device shares
    the queue, so its first use of the queue waits for that replay too."""
    _native_replays(True, monkeypatch)
    rt, other = registry.open_runtime("opencl"), registry.open_runtime("opencl")
    try:
        assert other._state is rt._state
        ones, weight = rt.from_numpy(np.ones((1, 256), np.float32)), rt.from_numpy(np.ones(256, np.float32))
        residual = rt.from_numpy(np.zeros((1, 256), np.float32))
        rt.begin_capture(("ids",))
        for _ in range(256):
            rt.ops.add_rmsnorm(
                ones, residual, weight, 1e-6, rt.empty((1, 256))
            )  # a fresh output each: kept by the graph
        graph = rt.end_capture()
        rt.replay(graph, {})
        del graph
        rt._launches.clear()  # the launch cache's kernels go too: only the running replay holds them now
        gc.collect()
        other.synchronize()  # waits for rt's replay: they share the queue
        assert rt._state.replaying is None
        np.testing.assert_array_equal(other.to_numpy(residual), np.full((1, 256), 512.0))
    finally:
        other.close()
        rt.close()


def test_native_replays_fall_back_to_python_where_they_cannot_be_built(registry, monkeypatch, tmp_path):
    """An unwritable cache directory (or no compiler) turns native replays off; steps are still recorded and
    replayed, from Python."""
    from perfx_opencl import native_replay

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PERFX_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("PERFX_OPENCL_NATIVE_REPLAY", "1")
    native_replay.replayer.cache_clear()
    rt = registry.open_runtime("opencl")
    try:
        assert native_replay.replayer() is None
        ones, weight = rt.from_numpy(np.ones((1, 8), np.float32)), rt.from_numpy(np.ones(8, np.float32))
        residual, out = rt.from_numpy(np.zeros((1, 8), np.float32)), rt.empty((1, 8))
        rt.begin_capture(("ids",))
        rt.ops.add_rmsnorm(ones, residual, weight, 1e-6, out)
        graph = rt.end_capture()
        assert graph is not None and graph.native is None
        rt.replay(graph, {})
        np.testing.assert_array_equal(rt.to_numpy(residual), np.full((1, 8), 2.0))
    finally:
        rt.close()
        native_replay.replayer.cache_clear()  # the next test finds the real cache again


def test_a_step_that_reads_back_is_not_recorded(registry):
    rt = registry.open_runtime("opencl")
    try:
        x = rt.from_numpy(np.ones((1, 4), np.float32))
        out = rt.empty((1, 2))
        rt.begin_capture(("ids",))
        rt.ops.silu_mul(x, out)
        rt.to_numpy(out)  # host work in the middle of a step: a replay would skip it
        assert rt.end_capture() is None
        rt.begin_capture(("ids",))
        rt.ops.silu_mul(x, out)
        graph = rt.end_capture()
        assert graph is not None and len(graph.launches) == 1
        rt.begin_capture(("ids",))
        rt.upload_ints("positions", np.arange(3))  # an input the replay is not given
        assert rt.end_capture() is None
    finally:
        rt.close()


def test_decode_argmax_and_sampling_on_the_device_match_the_logits(registry, smollm2_path):
    """decode(argmax=True) and decode(sampling=rows) pick on the device (one id per row comes back, also in a
    replayed step) and agree with the argmax / the reference draw (sampling.engine_draw) of the logits that
    decode() returns; the same seed and step draw the same token again."""
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel
    from perfx_core.sampling import Sampler, SamplingParams, engine_draw

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        assert rt.ops.sources["argmax"].startswith("opencl:")
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=64, prefill_chunk=16)
        for slot in range(3):
            model.prefill([1, 504, 3458 + slot], slot=slot)
        assert model.samples_on_device
        samplers = [
            Sampler(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=7))
            for t, m, k, p in ((1.0, 0.0, 40, 0.9), (0.7, 0.05, 0, 0.95), (0.0, 0.0, 0, 1.0))
        ]  # top-k and top-p on the device too; the last row greedy
        drawn = []
        for step in range(3):  # the second and third are replays of the first
            args = ([11, 12, 13], [0, 1, 2], [3 + step] * 3)
            ids = model.decode(*args, argmax=True)
            assert ids.dtype == np.int32 and ids.shape == (3,)
            logits = model.decode(*args)
            np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))
            rows = np.stack([s.engine_row() for s in samplers])
            sampled = model.decode(*args, sampling=rows)
            np.testing.assert_array_equal(sampled, [engine_draw(logits[i], rows[i]) for i in range(3)])
            assert sampled[2] == ids[2]
            drawn.append(sampled)
        rows = np.stack([s.engine_row() for s in samplers])
        rows[:, 3] = 0  # step 0 again
        again = [model.decode([11, 12, 13], [0, 1, 2], [3, 3, 3], sampling=rows) for _ in range(2)]
        np.testing.assert_array_equal(again[0], again[1])  # same seed and step: the same draw
        np.testing.assert_array_equal(again[0], drawn[0])
    finally:
        rt.close()


def test_a_graph_keeps_its_buffers_alive(registry, smollm2_path, monkeypatch):
    """A recorded step still replays correctly after the scratch buffers it used have grown (a longer prefill)
    and its launches have left the launch cache: the graph, not the cache, keeps those buffers alive."""
    import perfx_opencl.runtime as runtime_module

    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    monkeypatch.setattr(runtime_module, "MAX_CACHED_LAUNCHES", 200)
    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=1, max_seq_len=64, prefill_chunk=32)
        model.prefill([1, 504, 3458], slot=0)
        recorded = model.decode([11], [0], [3])  # recorded while the scratch buffers are small
        for length in (16, 32, 7, 9):  # grow the scratch buffers and push the step's launches out of the cache
            model.prefill(list(range(100, 100 + length)), slot=0)
        gc.collect()
        model.prefill([1, 504, 3458], slot=0)
        assert [key[0] for key in model._graphs].count(1) == 1  # one decode step (and the prompts' graphs)
        np.testing.assert_array_equal(model.decode([11], [0], [3]), recorded)  # a replay
    finally:
        rt.close()


@pytest.mark.parametrize(
    "variable, value, parse",
    [("PERFX_OPENCL_GEMV", "RW=32,UC=0", "gemv_overrides"), ("PERFX_OPENCL_MMA_SHAPE", "MT=3", "mma_overrides")],
)
def test_bad_kernel_shape_override_is_a_clear_error(registry, monkeypatch, variable, value, parse):
    from perfx_opencl import ops

    from perfx_core.errors import InvalidArgumentError

    monkeypatch.setenv(variable, value)
    getattr(ops, parse).cache_clear()
    try:
        with pytest.raises(InvalidArgumentError, match=variable):
            getattr(ops, parse)()
    finally:
        monkeypatch.delenv(variable)
        getattr(ops, parse).cache_clear()


def test_without_fused_tails_the_ops_use_separate_launches(registry, monkeypatch):
    """Devices where the last-work-group kernels are not known to be safe run add+RMSNorm and the attention
    merge as launches of their own; the results are the same (the conformance kit)."""
    monkeypatch.setenv("PERFX_OPENCL_FUSED_TAILS", "0")
    rt = registry.open_runtime("opencl")
    try:
        assert rt.fused_tails is False
    finally:
        rt.close()
    assert_backend_conforms("opencl", ops=["linear_add_rmsnorm", "attention_decode"])


@pytest.mark.slow
def test_scheduler_with_queued_steps_and_overlapped_output_matches_generation(registry):
    """On OpenCL a queued decode step runs while the scheduler handles the previous step's text (the server's
    default on GPUs): four requests in mixed and decode steps get what Generation gives, overlap on and off."""
    model = perfx_core.load(backend="opencl", context_length=256, n_slots=4)
    try:
        check_overlapped_output(model, mixed=True)
    finally:
        model.close()


@pytest.mark.slow
def test_seeded_sampling_is_the_same_on_numpy_and_opencl(registry, smollm2):
    """A seeded temperature/min-p generation draws on the device on OpenCL and on the host on NumPy: the same
    tokens (sampling.engine_draw is one definition for both)."""
    model = perfx_core.load(backend="opencl", context_length=256)
    try:
        kwargs = dict(max_tokens=24, temperature=0.8, top_k=0, top_p=1, min_p=0.05, seed=11, ignore_eos=True)
        ours, ref = model.generate(PROMPT, **kwargs), smollm2.generate(PROMPT, **kwargs)
        ours.run()
        ref.run()
        assert ours.token_ids == ref.token_ids, (ours.text, ref.text)
        greedy = model.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
        greedy.run()
        assert ours.token_ids != greedy.token_ids  # it did sample
    finally:
        model.close()


# -- quantized activations (QX): integer dot products ----------------------------------------------------------


def _float64_matmul(x: np.ndarray, weight, silu: bool = False) -> np.ndarray:
    """x @ W.T against the dequantized int4 weight in float64; with ``silu`` W is [W_gate; W_up] and the result
    silu(gate) * up, as the gate_up_silu op computes it."""
    from perfx_core import reference

    return reference.gate_up_silu(x, weight) if silu else reference.matmul(x, weight)


@pytest.fixture
def quantized_gemv(monkeypatch):
    """Every int4 GEMV with QX=1 (on by default only where dp4a is native; PoCL runs the portable dot)."""
    from perfx_opencl import ops

    monkeypatch.setenv("PERFX_OPENCL_GEMV", "QX=1")
    ops.gemv_overrides.cache_clear()
    yield
    monkeypatch.delenv("PERFX_OPENCL_GEMV")
    ops.gemv_overrides.cache_clear()


def test_quantized_activation_gemv_conforms(registry, quantized_gemv):
    assert_backend_conforms("opencl", ops=["int4_gemv", "int4_gemm", "gate_up_silu", "linear_add_rmsnorm"])


@pytest.mark.parametrize("n, silu, local_bytes", [(1, False, None), (3, True, None), (16, False, 8192)])
def test_quantized_activation_gemv_matches_float(registry, n, silu, local_bytes):
    """QX=1 against the dequantized weights in float64, next to QX=0: 16-bit activations keep the error near
    float rounding, an outlier column included; with little local memory x is staged in slices."""
    from perfx_opencl import ops

    from perfx_core.synthetic import random_int4

    rng = np.random.default_rng(n)
    m, k = 96, 4096
    weight = random_int4(2 * m if silu else m, k, 128, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, 7] = 60.0
    want = _float64_matmul(x, weight, silu)
    rt = registry.open_runtime("opencl")
    try:
        if local_bytes:
            rt.device.details["local_memory_bytes"] = local_bytes
        w, xs = rt.prepare_weight(weight), rt.from_numpy(x)
        errors = {}
        for qx in (0, 1):
            with ops.forced_gemv_tuning(rt, {**ops.GEMV_TUNING, "RW": 16, "KS": 4, "CR": 2, "QX": qx}):
                out = rt.empty((n, m))
                (ops.gate_up_silu if silu else ops.int4_gemm)(rt, xs, w, out)
                got = rt.to_numpy(out)
            errors[qx] = float(((got - want) ** 2).sum() / (want**2).sum())
        assert errors[0] < 1e-10 and errors[1] < 1e-7, errors
        slices = {dict(key[2]).get("QX_SLICE") for key in rt._kernels if key[1] == "int4_gemv"} - {False}
        if local_bytes:  # x staged 2 chunks at a time (the 128 chunks of x do not fit)
            assert slices == {2}
        else:
            assert slices and all(1 <= size <= k // 32 for size in slices)
    finally:
        rt.close()


@pytest.mark.parametrize("tpt", ["4", "8"])
def test_int4_gemm_tiles_cover_every_token_and_row(registry, monkeypatch, tpt):
    """n > 16 runs the tiled GEMM: several token tiles, a partial last tile of tokens and of rows, g32."""
    from perfx_opencl import ops

    from perfx_core.synthetic import random_int4

    monkeypatch.setenv("PERFX_OPENCL_GEMM_TPT", tpt)
    rng = np.random.default_rng(int(tpt))
    weight = random_int4(300, 256, 32, rng)
    x = rng.standard_normal((200, 256)).astype(np.float32)
    want = _float64_matmul(x, weight)
    rt = registry.open_runtime("opencl")
    try:
        out = rt.empty((200, 300))
        ops.int4_gemm(rt, rt.from_numpy(x), rt.prepare_weight(weight), out)
        np.testing.assert_allclose(rt.to_numpy(out), want, rtol=1e-4, atol=1e-3)
    finally:
        rt.close()


# -- matrix-unit int4 kernel (kernels/int4_mma.cl) -------------------------------------------------------------


@pytest.fixture
def matrix_units(monkeypatch):
    """Int4 matmuls of 2+ tokens on the mma kernel (native on NVIDIA; its portable emulation on PoCL)."""
    monkeypatch.setenv("PERFX_OPENCL_MMA", "1")


def test_matrix_unit_kernel_conforms(registry, matrix_units):
    assert_backend_conforms("opencl", ops=["int4_gemm", "gate_up_silu", "linear_add_rmsnorm"])


@pytest.mark.parametrize(
    "n, silu, group, k, shape",
    [
        (2, False, 128, 512, ""),  # one token tile, mostly empty
        (16, True, 32, 256, ""),  # gate|up with SiLU, scales changing every chunk
        (70, False, 64, 384, ""),  # several token tiles, a partial last one; 12 chunks over 2 warps
        (13, False, 32, 96, "KW=8"),  # 3 chunks: KW falls back to a divisor (1)
        (40, True, 128, 1024, "MT=1,NT8=1,KW=16"),
        (21, False, 32, 768, ""),  # three token tiles (17-24 tokens), the last one partial
        # Chunks loaded ahead (UC): 18 chunks per warp, so runs of 4 with single chunks after (warp 0) or before
        # (warp 1) them; groups of 64 columns cap UC at 2. PoCL's emulation runs UC = 1: these check UC > 1 where
        # it is native.
        (24, False, 128, 1152, "KW=2,UC=4"),
        (6, True, 64, 640, "UC=4"),
    ],
)
def test_matrix_unit_kernel_matches_float(registry, monkeypatch, matrix_units, n, silu, group, k, shape):
    """Half-precision inputs with float accumulation against float64: error at half rounding (~1e-7), over
    partial row and token tiles, an x view that is not 16-byte aligned, and forced shapes."""
    from perfx_opencl import ops

    from perfx_core.synthetic import random_int4

    monkeypatch.setenv("PERFX_OPENCL_MMA_SHAPE", shape)
    ops.mma_overrides.cache_clear()
    rng = np.random.default_rng(n)
    m = 72  # not a multiple of 16 rows per tile
    weight = random_int4(2 * m if silu else m, k, group, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = _float64_matmul(x, weight, silu)
    rt = registry.open_runtime("opencl")
    try:
        assert rt.use_mma
        padded = rt.from_numpy(np.concatenate([np.zeros(1, np.float32), x.ravel()]))
        xs = rt.view(padded, 1, (n, k))  # offset 1: the kernel's unaligned loads
        out = rt.empty((n, m))
        (ops.gate_up_silu if silu else ops.int4_gemm)(rt, xs, rt.prepare_weight(weight), out)
        got = rt.to_numpy(out)
        assert float(((got - want) ** 2).sum() / (want**2).sum()) < 1e-6
        built = [dict(key[2]) for key in rt._kernels if key[1] == "int4_mma"]
        assert built and all(b["X_UNALIGNED"] for b in built)
        if "UC=4" in shape:  # built as asked where native (capped at the group's chunks), else the emulation's 1
            assert all(b["UC"] == (min(4, group // 32) if rt.native_mma else 1) for b in built)
        if shape == "KW=8":
            assert built[0]["KW"] == 1
        if not shape:  # the default rule's token tiles: 1 up to 8 tokens, 2 up to 16, 3 up to 24, then 4
            assert built[0]["NT8"] == min(4, -(-n // 8))
    finally:
        rt.close()
        monkeypatch.delenv("PERFX_OPENCL_MMA_SHAPE")
        ops.mma_overrides.cache_clear()


@pytest.mark.parametrize("n", [3, 16, 17, 32, 33])
def test_linear_add_rmsnorm_on_matrix_units_is_one_launch(registry, monkeypatch, matrix_units, n):
    """Up to MMA_ADD_NORM_N (32) tokens the mma kernel adds the residual and norms it itself (add_norm_tail.cl;
    beyond 16 tokens in two groups of work-groups): the reference's residual and normed rows, twice in a row
    (its counters are set back to zero for the next launch), without an add_rmsnorm kernel; beyond 32, or with
    PERFX_OPENCL_NORM_FINISHERS=0, the two launches."""
    from perfx_opencl import ops

    from perfx_core import reference
    from perfx_core.synthetic import random_int4

    rng = np.random.default_rng(n)
    m, k, eps = 72, 256, 1e-5  # 72 rows: a partial row tile
    weight = random_int4(m, k, 32, rng)
    norm_weight = (1.0 + 0.3 * rng.standard_normal(m)).astype(np.float32)
    for finishers_cap in (None, "0"):
        if finishers_cap is not None:
            monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", finishers_cap)
        ops._norm_finishers_cap.cache_clear()
        rt = registry.open_runtime("opencl")
        try:
            w, residual = rt.prepare_weight(weight), rng.standard_normal((n, m)).astype(np.float32)
            residual_buffer, out = rt.from_numpy(residual), rt.empty((n, m))
            fused = finishers_cap is None and n <= ops.MMA_ADD_NORM_N
            for _ in range(2):
                x, norm = rng.standard_normal((n, k)).astype(np.float32), rt.from_numpy(norm_weight)
                x_buffer, launches = rt.from_numpy(x), rt.launch_count
                ops.linear_add_rmsnorm(rt, x_buffer, w, residual_buffer, norm, eps, out)
                assert rt.launch_count - launches == (1 if fused else 2)
                residual, normed = reference.linear_add_rmsnorm(x, weight, residual, norm_weight, eps)
                np.testing.assert_allclose(rt.to_numpy(residual_buffer), residual, rtol=1e-3, atol=1e-3)
                np.testing.assert_allclose(rt.to_numpy(out), normed, rtol=1e-3, atol=1e-3)
            built = {(key[1], dict(key[2]).get("ADD_NORM")) for key in rt._kernels}
            assert (("int4_mma", True) in built) == fused
            assert (("add_rmsnorm", None) in built) == (not fused)
            tiles = {dict(key[2])["NT8"] for key in rt._kernels if dict(key[2]).get("ADD_NORM")}
            assert tiles == (set() if not fused else {1} if n <= 8 else {2})  # 17-32: the 16-token shape
        finally:
            rt.close()
            ops._norm_finishers_cap.cache_clear()


def test_tail_finishers_rule(monkeypatch):
    """How many work-groups finish a launch's add + RMSNorm: one per token where a launch's work-groups run side
    by side, at most one per group and half the compute units, capped by PERFX_OPENCL_NORM_FINISHERS; else the
    last work-group alone. A cap that is not a whole number is refused."""
    from types import SimpleNamespace

    from perfx_opencl import ops

    from perfx_core.errors import InvalidArgumentError

    def finishers(n: int, groups: int, concurrent: bool = True) -> int:
        rt = SimpleNamespace(concurrent_groups=concurrent, device=SimpleNamespace(details={"compute_units": 132}))
        return ops._tail_finishers(rt, n, groups)

    try:
        monkeypatch.delenv("PERFX_OPENCL_NORM_FINISHERS", raising=False)
        ops._norm_finishers_cap.cache_clear()
        assert [finishers(16, 128), finishers(16, 8), finishers(200, 1000), finishers(16, 128, False)] == [16, 8, 66, 1]
        monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", "4")
        ops._norm_finishers_cap.cache_clear()
        assert [finishers(16, 128), finishers(2, 128), finishers(16, 128, False)] == [4, 2, 1]
        for bad in ("x", "-1", "\u00b2"):  # the last: a superscript two, which str.isdigit accepts
            monkeypatch.setenv("PERFX_OPENCL_NORM_FINISHERS", bad)
            ops._norm_finishers_cap.cache_clear()
            with pytest.raises(InvalidArgumentError, match="PERFX_OPENCL_NORM_FINISHERS"):
                finishers(16, 128)
    finally:
        ops._norm_finishers_cap.cache_clear()


def test_matrix_unit_shape_loads_chunks_ahead_within_a_group(registry, monkeypatch):
    """The mma shape rule's UC (chunks loaded ahead): 4 where a warp holds two row tiles of sums and one, three or
    four token tiles, 1 with two token tiles or four row tiles, never more than a group's chunks, an override capped
    the same way, and always 1 in the portable emulation (its barriers)."""
    from perfx_opencl import ops

    rt = registry.open_runtime("opencl")
    try:
        ops.mma_overrides.cache_clear()
        monkeypatch.delenv("PERFX_OPENCL_MMA_SHAPE", raising=False)
        # No kernel is built here: the rule is read as on a device without and with mma.sync.
        rt.__dict__["native_mma"] = False  # the emulation
        assert ops._mma_config(rt, 8, 4096, 4096, 128)["UC"] == 1
        rt.__dict__["native_mma"] = True
        uc = {(n, m, group, silu): ops._mma_config(rt, n, m, 4096, group, silu)["UC"] for n, m, group, silu in [
            (4, 4096, 128, False), (12, 4096, 128, False), (24, 4096, 128, False), (40, 4096, 128, False),
            (32, 4096, 128, False),
            (24, 11008, 128, True), (4, 11008, 128, True), (4, 4096, 32, False), (24, 4096, 64, False),
        ]}  # fmt: skip
        assert uc == {
            (4, 4096, 128, False): 4, (12, 4096, 128, False): 1, (24, 4096, 128, False): 4,
            (40, 4096, 128, False): 1, (32, 4096, 128, False): 4, (24, 11008, 128, True): 1, (4, 11008, 128, True): 4,
            (4, 4096, 32, False): 1, (24, 4096, 64, False): 2,
        }  # fmt: skip
        monkeypatch.setenv("PERFX_OPENCL_MMA_SHAPE", "UC=8")
        ops.mma_overrides.cache_clear()
        assert ops._mma_config(rt, 12, 4096, 4096, 128)["UC"] == 4
    finally:
        ops.mma_overrides.cache_clear()
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("variable, value", [("PERFX_OPENCL_GEMV", "QX=1"), ("PERFX_OPENCL_MMA", "1")])
def test_smollm2_with_a_forced_kernel_matches_numpy(registry, smollm2, monkeypatch, variable, value):
    """The quantized-activation GEMV (decode) or the mma kernel (prompts, and the logits check's ~32 tokens),
    forced where they are not the default: the same greedy tokens as NumPy and logits NMSE < 1e-4."""
    from perfx_opencl import ops

    monkeypatch.setenv(variable, value)
    ops.gemv_overrides.cache_clear()
    model = perfx_core.load(backend="opencl", context_length=128)
    try:
        ours = model.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        ours.run()
        ref = smollm2.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        ref.run()
        assert ours.token_ids == ref.token_ids, (ours.text, ref.text)
        ids = model.tokenizer.encode(PROMPT, add_special=True) + ref.token_ids
        got, want = model.logits(ids), smollm2.logits(ids)
        assert float(((got - want) ** 2).sum() / (want**2).sum()) < 1e-4
    finally:
        model.close()
        monkeypatch.delenv(variable)
        ops.gemv_overrides.cache_clear()


def test_warm_up_records_the_steps_a_server_runs(registry, smollm2_path, monkeypatch):
    """After warm_up every batch size, at each reachable attention signature and with each way of picking
    tokens, replays a recording: no step a server runs is recorded (or compiled) while requests wait."""
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel
    from perfx_core.sampling import engine_params

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=160, prefill_chunk=16)
        model.warm_up()
        signatures = {key[1] for key in model._graphs if key[0] != "prefill"}
        assert len(signatures) == 3  # positions 0-63, 64-127, 128-159: 1, 2 and 4 decode partitions
        assert len([key for key in model._graphs if key[0] != "prefill"]) == 3 * 3 * 3
        replays = []
        replay = rt.replay
        monkeypatch.setattr(rt, "replay", lambda graph, inputs: (replays.append(graph), replay(graph, inputs)))
        before = len(model._graphs)
        model.prefill([1, 504, 3458], slot=1)
        model.decode([5, 6], [0, 1], [70, 3], argmax=True)
        model.decode([5, 6, 7], [0, 1, 2], [150, 4, 9], sampling=np.stack([engine_params(0.7, 0.1, 0, 3)] * 3))
        model.decode([5], [2], [10])
        assert len(replays) == 4 and len(model._graphs) == before
    finally:
        rt.close()


def test_tiled_prefill_attention_with_small_tiles_conforms(registry, monkeypatch):
    """Devices with little local memory (or head_dim 256 on 48 KB) run the prefill attention in 8-row tiles,
    also inside the mixed steps' one-launch attention."""
    from perfx_opencl import ops

    tiles = []
    monkeypatch.setattr(ops, "_prefill_tile", lambda rt, hd, beside=0: tiles.append((hd, beside)) or 8)
    assert_backend_conforms("opencl", ops=["attention_prefill", "attention_mixed"])
    assert (256, 0) in tiles and any(beside for _, beside in tiles)


@pytest.mark.parametrize(
    "part, groups_per_cu, score_bytes",
    [(16, 512, 8192), (64, 1, 8192), (16, 1, 256)],
    ids=["many-splits", "fewest-splits", "more-splits-than-a-merge-slice"],
)
def test_decode_attention_conforms_however_the_context_is_split(
    registry, monkeypatch, part, groups_per_cu, score_bytes
):
    """The fused decode kernel cuts each row's context into runs sized by depth and device (ops._decode_plan):
    many short runs (empty trailing ones included, merged by the last work-group), one per MAX_SPLIT, or runs
    so short that the merge takes the splits in several slices of MAX_SPLIT."""
    from perfx_opencl import ops

    plans = []
    real_plan = ops._decode_plan

    def plan(*args):
        plans.append(real_plan(*args))
        return plans[-1]

    monkeypatch.setattr(ops, "DECODE_PART", part)
    monkeypatch.setattr(ops, "DECODE_GROUPS_PER_CU", groups_per_cu)
    monkeypatch.setattr(ops, "DECODE_SCORE_BYTES", score_bytes)
    monkeypatch.setattr(ops, "MIXED_DECODE_SCORE_BYTES", min(score_bytes, ops.MIXED_DECODE_SCORE_BYTES))
    monkeypatch.setattr(ops, "_decode_plan", plan)
    assert_backend_conforms("opencl", ops=["attention_decode", "attention_mixed"])
    splits = [p[0] for p in plans if p is not None]
    assert max(splits) > (8 if part == 16 else 1) and min(splits) == 1
    if score_bytes < 1024:
        assert any(p[0] > p[1]["MAX_SPLIT"] for p in plans if p is not None)


def test_decode_splits_follow_depth_and_device(registry):
    """Few splits where the kv heads and rows already fill the device, more at depth, never longer than
    MAX_SPLIT, and the same for every position of one graph-signature bucket."""
    from perfx_opencl import ops

    from perfx_core.backend import AttentionSpec, KVCacheSpec

    rt = registry.open_runtime("opencl")
    try:
        rt.device = dataclasses.replace(rt.device, details={**rt.device.details, "compute_units": 132})
        spec = AttentionSpec(32, 32, 128)
        cache = rt.new_kv_cache(KVCacheSpec(1, 16, 4096, 32, 128, "float16"))

        def splits(positions):
            return ops._decode_plan(rt, cache, np.array(positions), spec, ops.DECODE_SCORE_BYTES)[0]

        assert splits([10]) == 1 and splits([511]) == 8  # one split per DECODE_PART positions at most
        assert splits([2047]) == splits([2000]) == 17  # 4 work-groups per compute unit, 32 kv heads, batch 1
        assert splits([2047] * 16) == 2  # batch 16: the rows fill the device
        assert splits([4095] * 16) == 2  # runs of 2048 positions: MAX_SPLIT at one query head per kv head
        assert ops._decode_plan(rt, cache, np.array([4095]), spec, ops.DECODE_SCORE_BYTES)[1]["MAX_SPLIT"] == 2048
    finally:
        rt.close()


def test_recorded_mixed_steps_replay_exactly(registry, smollm2_path, monkeypatch):
    """Mixed steps (decode rows + a prompt chunk) of 3 and 7 prompt tokens share one recording (padded to 8
    rows, MIXED_GRAPH_ROUNDING), 12 tokens pad to 16: a run that records then replays equals a run that only
    replays, and both match running every op unpadded (to float rounding: the padded matmuls sum in another
    order). A step's attention is one launch per layer (attention_mixed)."""
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=2, max_seq_len=96, prefill_chunk=32)

        def run(graphs: str, clear: bool = True) -> list[np.ndarray]:
            monkeypatch.setenv("PERFX_OPENCL_GRAPHS", graphs)
            if clear:
                model._graphs.clear()
            model.prefill([1, 504, 3458], slot=0)
            out, start, position = [], 0, 3
            for length in (3, 7, 12):
                chunk = [100 + i for i in range(length)]
                out.append(model.decode([9], [0], [position], prompt=(chunk, 1, start), argmax=True))
                out.append(model.decode([9], [0], [position + 1], prompt=(chunk[:2], 1, start + length)))
                start, position = start + length + 2, position + 2
            return out

        plain = run("0")
        replays = []
        replay = rt.replay
        monkeypatch.setattr(rt, "replay", lambda graph, inputs: (replays.append(graph), replay(graph, inputs)))
        recorded = run("1")
        # Recorded: argmax and logits back next to 8 prompt rows (3 and 2 tokens), argmax next to 16 (12 tokens).
        assert len(replays) == 6 - 3
        replayed = run("1", clear=False)
        assert len(replays) == 3 + 1 + 6  # the prompt and every step
        # Each layer's decode and prompt attention is one attention_mixed launch.
        names = [name for _, _, _, name in replays[-1].launches]
        assert names.count("attention_mixed") == config.n_layers
        assert "attention_prefill" not in names and "attention_decode_fused" not in names
        for a, b, c in zip(plain, recorded, replayed, strict=True):
            np.testing.assert_array_equal(b, c)
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    finally:
        rt.close()


def test_mixed_attention_is_two_launches_past_its_decode_limit(registry, smollm2_path, monkeypatch):
    """A mixed step's attention is one attention_mixed launch while its decode rows x attention partitions stay
    within MIXED_ATTENTION_MAX_GROUPS, else the decode and prefill kernels (at long contexts the mixed kernel's
    local memory costs the decode rows more than the launch it saves)."""
    from perfx_opencl import ops

    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    monkeypatch.setattr(ops, "MIXED_ATTENTION_MAX_GROUPS", 2)
    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=256, prefill_chunk=32)
        for positions, one_launch in (([5, 6], True), ([5, 200], False)):  # 1 partition each; 200 needs 4
            model._graphs.clear()
            model.decode([9, 9], [0, 1], positions, prompt=([1, 2, 3], 2, 0), argmax=True)
            names = [name for graph in model._graphs.values() for *_, name in graph.launches]
            assert names.count("attention_mixed") == (config.n_layers if one_launch else 0)
            assert names.count("attention_decode_fused") == (0 if one_launch else config.n_layers)
    finally:
        rt.close()


def test_warm_up_for_mixed_steps_records_them(registry, smollm2_path, monkeypatch):
    """warm_up(mixed_steps=True) also records decode + prompt-chunk steps at each padded size a chunk of up to
    mixed_chunk tokens takes (8 and 16 rows for 16 tokens), so a server's mixed step with a short prompt chunk
    replays instead of recording while others wait; within its share of the graph store."""
    from perfx_core import model as model_module
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    try:
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=100, prefill_chunk=32)
        model.warm_up(mixed_steps=True, mixed_chunk=16)
        mixed = {key[0] for key in model._graphs if isinstance(key[0], tuple)}
        assert mixed == {("mixed", batch, rows) for batch in (1, 2) for rows in (8, 16)}
        replays = []
        replay = rt.replay
        monkeypatch.setattr(rt, "replay", lambda graph, inputs: (replays.append(graph), replay(graph, inputs)))
        before = len(model._graphs)
        model.decode([5, 6], [0, 1], [70, 3], prompt=([1, 2, 3, 4, 5], 2, 0), argmax=True)
        assert len(replays) == 1 and len(model._graphs) == before
        # A small graph store: the warm-up keeps to its share and never drops the prefills it recorded first.
        monkeypatch.setattr(model_module, "MAX_GRAPHS", 40)
        model._graphs.clear()
        model.warm_up(mixed_steps=True, mixed_chunk=64)
        assert len(model._graphs) <= 40 - 40 // 8
        assert sum(key[0] == "prefill" for key in model._graphs) == 2  # its prompts, padded to 16 and 32 rows
        small = LlamaModel(config, weights, rt, n_slots=2, max_seq_len=12, prefill_chunk=8)
        small.warm_up(mixed_steps=True, mixed_chunk=8)  # 7 tokens of room next to a decode row: no padded size fits
        assert not [key for key in small._graphs if isinstance(key[0], tuple)] and small._graphs
    finally:
        rt.close()


def test_mixed_steps_with_other_decode_positions_do_not_share_a_recording(registry, smollm2_path, monkeypatch):
    """Two mixed steps whose prompt chunks end in the same attention bucket but whose decode rows do not (10
    vs 100 positions) must not replay one recording: each part's launches follow its own positions."""
    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel

    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, n).tolist() for n in (100, 10, 102)]
    try:
        model = LlamaModel(config, weights, rt, n_slots=3, max_seq_len=256, prefill_chunk=64)

        def run(graphs: str) -> np.ndarray:
            monkeypatch.setenv("PERFX_OPENCL_GRAPHS", graphs)
            model._graphs.clear()
            for slot, prompt in enumerate(prompts):
                model.prefill(prompt[:70] if slot == 2 else prompt, slot=slot)
            model.decode([11], [1], [10], prompt=(prompts[2][70:86], 2, 70))
            return model.decode([12], [0], [100], prompt=(prompts[2][86:102], 2, 86))

        np.testing.assert_array_equal(run("1"), run("0"))
    finally:
        rt.close()


def test_a_q4_0_model_computes_without_stored_biases_what_the_numpy_backend_does(tmp_path):
    """A GGUF Q4_0 model on OpenCL keeps no biases (each is -8 * its scale, kernels/int4_bias.cl): the GEMV of
    one token and the prompt path (GEMM or matrix units) and the embedding give the NumPy backend's logits."""
    from tiny_gguf import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type="Q4_0", dim=128, ffn_dim=256, seed=6).path
    ids = [1, 5, 9, 3, 7, 2, 8, 4] * 5
    with perfx_core.load(path, backend="opencl") as cl_model, perfx_core.load(path, backend="numpy") as np_model:
        assert cl_model.engine.layers[0].w_qkv.bias is None and cl_model.engine.embedding.bias is None
        for n in (1, len(ids)):
            got, want = cl_model.logits(ids[:n]), np_model.logits(ids[:n])
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
