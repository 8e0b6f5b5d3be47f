"""The parts of `perfx serve --ray` that need no Ray cluster: the prefix key requests are routed by, the merge of
the replicas' /metrics, a replica's device choice, the CLI's checks, and that plain `perfx serve` never imports
Ray. The deployment itself runs in tests/test_ray_serve.py (a long module)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from perfx_core.backend import DeviceInfo
from perfx_core.errors import InvalidArgumentError
from perfx_core.serving.metrics import ServerMetrics
from perfx_core.serving.scaleout.affinity import rank_by_affinity
from perfx_core.serving.scaleout.asgi_bridge import ForwardedRequest, call_app
from perfx_core.serving.scaleout.devices import replica_device, replica_gpus
from perfx_core.serving.scaleout.metrics_merge import ReplicaMetrics, merge
from perfx_core.serving.scaleout.prefix_key import COMPLETION_PREFIX_CHARS, prefix_key
from perfx_core.serving.scaleout.settings import ReplicaSettings
from perfx_core.serving.scheduler import Scheduler

CHAT = "/v1/chat/completions"


def _chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages], "max_tokens": 4}).encode()


def test_a_conversation_keeps_its_key_as_it_grows_and_others_differ():
    opening = [("system", "Be brief."), ("user", "What is the capital of France?")]
    first = prefix_key(CHAT, _chat(*opening))
    later = prefix_key(CHAT, _chat(*opening, ("assistant", "Paris."), ("user", "And of Spain?")))
    assert first is not None and first == later
    assert prefix_key(CHAT, _chat(("system", "Be brief."), ("user", "What is the capital of Italy?"))) != first
    assert prefix_key(CHAT, _chat(("system", "Be long."), ("user", "What is the capital of France?"))) != first
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    parts = json.dumps({"messages": [system, {"role": "user", "content": "What is the capital of France?"}]}).encode()
    assert prefix_key(CHAT, parts) == first  # content parts are read as their text


def test_completion_keys_cover_the_prompt_start_and_token_prompts():
    base = "A" * COMPLETION_PREFIX_CHARS
    key = prefix_key("/v1/completions", json.dumps({"prompt": base + " one"}).encode())
    assert key == prefix_key("/v1/completions", json.dumps({"prompt": [base + " two", "x"]}).encode())
    assert key != prefix_key("/v1/completions", json.dumps({"prompt": "B" + base}).encode())
    ids = prefix_key("/v1/completions", json.dumps({"prompt": list(range(100))}).encode())
    assert ids is not None and ids == prefix_key("/v1/completions", json.dumps({"prompt": list(range(70))}).encode())


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[" * 100_000),  # deeper than the parser goes: no key, and no crash
        ("/v1/completions", b'{"max_tokens": 4}'),
        (CHAT, b'{"messages": "hello"}'),
        (CHAT, b'{"messages": [1, 2]}'),
        ("/tokenize", b'{"prompt": "hi"}'),
        ("/v1/completions", b""),
    ],
)
def test_requests_without_a_usable_prompt_have_no_key(path, body):
    assert prefix_key(path, body) is None


def test_only_the_keys_of_a_replica_that_leaves_or_comes_move():
    """Rendezvous hashing over replica ids: a replica going away moves only the keys it had, a new one takes
    only keys for itself, and keys spread over all replicas."""
    keys = [prefix_key("/v1/completions", json.dumps({"prompt": f"document {i}"}).encode()) for i in range(300)]
    three = ["a1b2c3d4", "e5f6g7h8", "i9j0k1l2"]
    before = {k: rank_by_affinity(k, three)[0] for k in keys}
    assert all(sum(owner == r for owner in before.values()) > 60 for r in three)  # about 100 each
    after_leave = {k: rank_by_affinity(k, three[:2])[0] for k in keys}
    assert {k for k in keys if after_leave[k] != before[k]} == {k for k in keys if before[k] == three[2]}
    after_join = {k: rank_by_affinity(k, [*three, "m3n4o5p6"])[0] for k in keys}
    assert all(after_join[k] in (before[k], "m3n4o5p6") for k in keys)


def _replica_text(model, finished: int, max_batch: int) -> str:
    """The /metrics text of a server on ``model`` whose scheduler (real, not started) is attached."""
    metrics = ServerMetrics()
    metrics.requests_finished.labels("length").inc(finished)
    metrics.generation_tokens.inc(10 * finished)
    metrics.time_to_first_token.observe(0.05 * finished)
    scheduler = Scheduler(model.engine, model.tokenizer, max_queue=4, prefill_chunk=64)
    scheduler.max_batch_size = max_batch  # as its decode steps would have left it
    metrics.attach(scheduler)
    return metrics.render().decode()


def test_replica_metrics_add_up_and_name_each_replica(smollm2):
    replicas = [
        ReplicaMetrics("aaaa", "10.0.0.1", 11, _replica_text(smollm2, 3, 4)),
        ReplicaMetrics("bbbb", "10.0.0.2", 22, _replica_text(smollm2, 5, 2)),
    ]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merge(replicas).decode())
        for s in family.samples
    }
    assert samples[("perfx_requests_finished_total", (("finish_reason", "length"),))] == 8
    assert samples[("perfx_generation_tokens_total", ())] == 80
    assert samples[("perfx_time_to_first_token_seconds_count", ())] == 2
    assert samples[("perfx_time_to_first_token_seconds_sum", ())] == pytest.approx(0.4)
    assert samples[("perfx_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert samples[("perfx_kv_cache_slots_total", ())] == 2 * smollm2.engine.n_slots
    assert samples[("perfx_model_loaded", ())] == 2  # so many replicas serving
    assert samples[("perfx_max_decode_batch_size", ())] == 4  # the largest, not a sum
    assert samples[("perfx_replicas", ())] == 2
    assert samples[("perfx_replica_info", (("node", "10.0.0.2"), ("pid", "22"), ("replica", "bbbb")))] == 1
    assert samples[("perfx_replica_requests_running", (("replica", "aaaa"),))] == 0
    assert samples[("perfx_replica_requests_waiting", (("replica", "bbbb"),))] == 0


def _gpu(index: int, vendor: str) -> DeviceInfo:
    return DeviceInfo(index, f"GPU {index}", "gpu", details={"vendor": vendor})


def test_a_replica_opens_the_gpu_ray_reserved_for_it():
    cpu = DeviceInfo(0, "PoCL CPU", "cpu")
    two = [cpu, _gpu(1, "NVIDIA Corporation"), _gpu(2, "NVIDIA Corporation")]
    assert replica_device(two, ["1"]) == 2  # the driver shows every GPU: the one at Ray's id
    assert replica_device(two, ["0"]) == 1
    assert replica_device([cpu, _gpu(1, "NVIDIA Corporation")], ["5"]) == 1  # it shows only the reserved one
    with_igpu = [_gpu(0, "Intel(R) Corporation"), _gpu(1, "NVIDIA Corporation")]
    assert replica_device(with_igpu, ["3"]) == 1  # not the integrated GPU, which Ray does not count
    assert replica_device(two, []) is None and replica_device([cpu], ["0"]) is None
    assert replica_gpus("opencl", cluster_gpus=2, requested=None) == 1
    assert replica_gpus("opencl", cluster_gpus=0, requested=None) == 0
    assert replica_gpus("numpy", cluster_gpus=2, requested=None) == 0
    assert replica_gpus("numpy", cluster_gpus=0, requested=0.5) == 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replicas": 2, "min_replicas": 1, "max_replicas": 2}, "not both"),
        ({"min_replicas": 1}, "needs both"),
        ({"min_replicas": 3, "max_replicas": 2}, "must not exceed"),
        ({"replicas": 0}, "replicas must be an integer >= 1"),
        ({"cpus": 0}, "replica-cpus must be > 0"),
        ({"target_ongoing_requests": -1}, "target-ongoing-requests must be > 0"),
    ],
)
def test_bad_replica_settings_are_typed_errors(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ReplicaSettings(**kwargs)


def test_replicas_on_cpus_get_as_many_threads_as_cpus():
    assert ReplicaSettings(cpus=0.5).thread_env(gpus=0)["NUMBA_NUM_THREADS"] == "1"
    assert ReplicaSettings(cpus=3).thread_env(gpus=0)["OMP_NUM_THREADS"] == "3"
    assert ReplicaSettings(cpus=1).thread_env(gpus=1) == {}


async def _echo_app(scope, receive, send):
    """A small ASGI app: streams the request body back in three pieces, or fails when asked to."""
    body = (await receive())["body"]
    if body == b"fail":
        raise RuntimeError("asked to fail")
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-path", scope["path"].encode())]})
    for piece in (body[:2], body[2:]):
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("body", [b"hello", b"fail"])
def test_the_bridge_runs_an_asgi_app_on_a_forwarded_request(body):
    async def run():
        request = ForwardedRequest("POST", "/p", body=body)
        return [m async for batch in call_app(_echo_app, request, [(b"x-r", b"1")]) for m in batch]

    messages = asyncio.run(run())
    start = messages[0]
    assert start["type"] == "http.response.start" and (b"x-r", b"1") in start["headers"]
    if body == b"fail":  # the app failed before answering: a 500 in OpenAI's error shape
        assert start["status"] == 500 and json.loads(messages[1]["body"])["error"]["type"] == "server_error"
    else:
        assert start["status"] == 201 and (b"x-path", b"/p") in start["headers"]
        assert b"".join(m.get("body", b"") for m in messages[1:]) == b"hello"
        assert messages[-1]["more_body"] is False


def test_plain_serve_never_imports_ray_and_ray_options_need_ray():
    """Building `perfx serve`'s app and parsing its options leaves Ray unimported; --ray's options alone, or
    contradictory ones, are refused before anything starts."""
    script = """
import sys
from perfx_core.cli import build_parser
from perfx_core.default_model import bundled_model_path
from perfx_core.serving import ServerConfig, create_app
args = build_parser().parse_args(["serve", "--port", "0"])
create_app(ServerConfig(model_path=bundled_model_path()))
print("ray" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
    for options, message in (
        (["--replicas", "2"], "--replicas only apply with --ray"),
        (["--replica-cpus", "0.5"], "--replica-cpus only apply with --ray"),
        (["--ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "2"], "not both"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "perfx_core.serving", "--port", "0", *options],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and message in run.stderr, run.stderr
