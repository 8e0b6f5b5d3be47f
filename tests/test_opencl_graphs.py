"""OpenCL graphs: recorded decode, prefill and mixed steps replayed (from Python and from the native thread), warm-up,
sampling on the device, and the scheduler's queued steps, all against running every op or the NumPy backend."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
from opencl_support import PROMPT, opencl_usable
from scheduler_check import check_overlapped_output

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'perfx[opencl]')")


import perfx_core  # noqa: E402
from perfx_core.errors import BackendError  # noqa: E402

pytestmark = opencl_usable


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


@pytest.mark.parametrize("native", [True, False], ids=["native-replay", "python-replay"])
def test_chained_decode_steps_take_their_ids_from_the_previous_picks_on_the_device(
    registry, smollm2_path, monkeypatch, native
):
    """queue_decode(previous step) queues the next step before the previous token is read: a replayed step
    copies the previous step's pick (argmax, or a seeded draw) into its ids on the device. The same tokens as
    reading each id back and passing it, across a new recording (the 64-position partition boundary) and with
    another slot's step in between (the chain's next ids then come back through the host)."""
    from perfx_opencl.device_handles import CLTensor

    from perfx_core.gguf_loader import load_llama_gguf
    from perfx_core.model import LlamaModel
    from perfx_core.sampling import Sampler, SamplingParams

    _native_replays(native, monkeypatch)
    config, weights, _ = load_llama_gguf(smollm2_path)
    rt = registry.open_runtime("opencl")
    fed = []  # per replay: were the ids a device tensor?
    replay = rt.replay
    monkeypatch.setattr(
        rt, "replay", lambda graph, inputs: (fed.append(isinstance(inputs["ids"], CLTensor)), replay(graph, inputs))
    )
    try:
        model = LlamaModel(config, weights, rt, n_slots=2, max_seq_len=160, prefill_chunk=16)
        prompt = [1, 504, 3458, 282, 4649, 314]

        def run(chained: bool, draw: bool) -> list[int]:
            sampler = Sampler(SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.02, seed=5))

            def pick() -> dict:
                return {"sampling": sampler.engine_row()[None, :]} if draw else {"argmax": True}

            model._graphs.clear()
            model.prefill(prompt, slot=0)
            model.prefill(prompt[:3], slot=1)
            fed.clear()
            start, tokens = len(prompt), []
            step = model.queue_decode([7], [0], [start], **pick())
            for i in range(70):  # positions 6..76: across the boundary at 64
                ahead = model.queue_decode(step, [0], [start + i + 1], **pick()) if chained else None
                if i == 30:
                    model.decode([9], [1], [3], argmax=True)  # another slot's step between the two
                tokens.append(int(step.result()[0]))
                step = ahead or model.queue_decode([tokens[-1]], [0], [start + i + 1], **pick())
            step.result()
            return tokens

        for draw in (False, True):
            plain = run(chained=False, draw=draw)
            assert not any(fed)
            chained = run(chained=True, draw=draw)
            assert chained == plain
            # Every chained step but the one after a new recording (the boundary) and the one after slot 1's
            # step replays with its ids from the device.
            assert fed.count(True) == 70 - 2, fed
        assert len(set(plain)) > 5  # the draws vary: not one token repeated
    finally:
        rt.close()


def test_generations_with_chained_steps_end_and_continue_as_on_numpy(registry, smollm2):
    """Generation on OpenCL queues each step before reading the previous token: replies that end on an end token,
    on max_tokens (1, 2) or on a stop string give NumPy's tokens, and a follow-up prompt that extends a reply (its
    prefix found in the slot's cache, past which the dropped step wrote) continues as on NumPy."""
    model = perfx_core.load(backend="opencl", context_length=256)

    def both(prompt, **kwargs):
        """The greedy generation of ``prompt`` on OpenCL and on NumPy, run."""
        runs = model.generate(prompt, temperature=0, **kwargs), smollm2.generate(prompt, temperature=0, **kwargs)
        for generation in runs:
            generation.run()
        return runs

    try:
        cases = [dict(max_tokens=60), dict(max_tokens=1), dict(max_tokens=2), dict(max_tokens=60, stop=[" the"])]
        for kwargs in cases:
            ours, ref = both(PROMPT, **kwargs)
            assert ours.token_ids == ref.token_ids and ours.text == ref.text, kwargs
            assert ours.stats.finish_reason == ref.stats.finish_reason
        ended = model.generate(PROMPT, temperature=0, max_tokens=60)
        ended.run()
        assert ended.stats.finish_reason == "stop"  # an end token: the step queued after it was dropped
        ours, ref = both(PROMPT + ended.text + " And Spain's?", max_tokens=12)
        assert ours.stats.cached_prompt_tokens > len(model.tokenizer.encode(PROMPT))  # the reply's cache was reused
        assert ours.token_ids == ref.token_ids
    finally:
        model.close()


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
