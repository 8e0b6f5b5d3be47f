"""`perfx serve --ray` end to end: SmolLM2 engine replicas on Ray Serve behind one OpenAI endpoint, on a local Ray
cluster of 2 CPUs (one for the module: each start costs seconds), half a CPU per replica.

The single server's tests of routes, streaming and bad input run here too, against the Ray deployment (imported
from tests/test_serving.py, with this module's `server`). Then: both replicas serve, a conversation stays on the
replica that caches its prefix and moves to the least-loaded one while that replica is full, the guard's Host and
Content-Type checks at the ingress, /metrics adds the replicas up, a replica killed mid-stream, scaling 1 -> 2 -> 1
under load, 429 once every replica's queue is full, and the `perfx serve --ray` command joining the cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import ray
from ray import serve
from test_serving import (  # noqa: F401  (fixtures and tests, collected here against the Ray deployment)
    API_KEY,
    CONTEXT,
    PROMPT,
    SERVER_ENV,
    Server,
    _free_port,
    _streaming_request,
    client,
    greedy,
    reference,
    test_api_key_is_required_except_for_health,
    test_bad_parameters_are_400_with_openai_error,
    test_body_over_one_mib_is_413,
    test_chat_whole_and_streamed_equal_generate,
    test_client_disconnect_cancels_and_frees_the_slot,
    test_context_overflow_names_both_numbers,
    test_greedy_completion_equals_generate,
    test_load_generator_measures_a_real_server,
    test_malformed_json_is_400,
    test_stop_string_ends_with_stop,
    test_streamed_completion_with_usage,
)

from perfx_core.default_model import bundled_model_path
from perfx_core.serving.config import ServerConfig
from perfx_core.serving.scaleout.affinity import rank_by_affinity
from perfx_core.serving.scaleout.deployments import APP_NAME, build_app
from perfx_core.serving.scaleout.prefix_key import prefix_key
from perfx_core.serving.scaleout.settings import ReplicaSettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = "/v1/chat/completions"
# Serve's autoscaler hears of ongoing requests every 0.5 s instead of 10 s (the controller inherits these).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
REPLICA_ENV = {k: SERVER_ENV[k] for k in ("PERFX_DISABLE_PLUGINS", "OPENBLAS_NUM_THREADS")}
CONFIG = ServerConfig(
    model_path=bundled_model_path(), context_length=CONTEXT, max_running=4, max_queue=8, api_key=API_KEY
)
TWO = ReplicaSettings(replicas=2, cpus=0.5, env=REPLICA_ENV)


class RayServer:
    """The deployment's endpoint, shaped like test_serving.Server for its tests."""

    headers = {"Authorization": f"Bearer {API_KEY}"}
    metrics = Server.metrics

    def __init__(self, url: str):
        self.url = url

    def replicas(self) -> dict[str, int]:
        """Replica id -> process id, from /metrics."""
        found = {}
        for name in self.metrics():
            if name.startswith("perfx_replica_info{"):
                labels = dict(part.split("=", 1) for part in name[len("perfx_replica_info{") : -1].split(","))
                found[labels["replica"].strip('"')] = int(labels["pid"].strip('"'))
        return found


def _deploy(settings: ReplicaSettings, config: ServerConfig = CONFIG) -> None:
    serve.run(build_app(config, settings, bundled_model=True), name=APP_NAME, route_prefix="/")


def _wait_for(predicate, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {timeout:g} s")


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        for name, value in RAY_ENV.items():
            env.setenv(name, value)
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)
        port = _free_port()
        serve.start(
            http_options={"host": "127.0.0.1", "port": port},
            logging_config={"enable_access_log": False, "log_level": "WARNING"},
        )
        try:
            yield RayServer(f"http://127.0.0.1:{port}")
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def server(cluster, request):
    request.getfixturevalue("reference")  # the greedy reference computes meanwhile, in a process of its own
    _deploy(TWO)
    _wait_for(lambda: len(cluster.replicas()) == 2, 60, "two replicas in /metrics")
    return cluster


def _stream(server: RayServer, body: dict, out: dict, key, first_token: threading.Event | None = None) -> None:
    """POST a streaming completion; out[key] = (status, replica header, data lines, when it ended), with status
    "error" and the exception as the header when the connection failed."""
    lines: list[str] = []
    try:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=server.headers, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    lines.append(line[5:].strip())
                    if first_token is not None and len(lines) == 1:
                        first_token.set()
            out[key] = (response.status_code, response.headers.get("x-perfx-replica"), lines, time.monotonic())
    except httpx.HTTPError as exc:
        out[key] = ("error", repr(exc), lines, time.monotonic())


def test_both_replicas_serve_concurrent_streams(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        with sdk.completions.with_streaming_response.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=12,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ) as response:
            results[i] = (response.headers["x-perfx-replica"], list(response.parse()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]  # more than one replica's 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(8))
    assert all(chunks[-1].usage.completion_tokens == 12 for _, chunks in results.values())
    assert {replica for replica, _ in results.values()} == set(server.replicas())  # both, by the header


def test_a_conversation_stays_on_the_replica_caching_its_prefix(server):
    """Each turn of a conversation goes to the replica rendezvous hashing gives its opening messages (while that
    one has free slots, as here), and that replica's prefix cache serves the repeated history."""
    replicas = list(server.replicas())
    cached_before = server.metrics()["perfx_prompt_tokens_cached_total"]
    for conversation in range(3):
        messages = [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"Question {conversation}: name a colour of the sea."},
        ]
        for _ in range(3):
            body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
            expected = rank_by_affinity(prefix_key(CHAT, json.dumps(body).encode()), replicas)[0]
            response = httpx.post(server.url + CHAT, json=body, headers=server.headers, timeout=120)
            assert response.status_code == 200, response.text
            assert response.headers["x-perfx-replica"] == expected
            reply = response.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    # Two later turns of each of three conversations found their history cached: many tokens, not a few.
    assert server.metrics()["perfx_prompt_tokens_cached_total"] - cached_before >= 6 * 20


def test_a_prefix_whose_replica_is_full_goes_to_the_least_loaded(server):
    """While the replica a prefix belongs to has --max-running (4) requests running and the other fewer, a request
    with that prefix goes to the other replica instead of waiting for a slot; once they end, back to its own."""
    replicas = list(server.replicas())
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    affine = rank_by_affinity(prefix_key("/v1/completions", json.dumps(body).encode()), replicas)[0]
    other = next(r for r in replicas if r != affine)

    def served_by() -> str:
        response = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.headers["x-perfx-replica"]

    assert served_by() == affine
    opened = []
    try:
        for _ in range(CONFIG.max_running):  # long streams of the same prompt, each read to its first token
            opened.append(_streaming_request(server))
        assert [response.headers["x-perfx-replica"] for _, response, _ in opened] == [affine] * CONFIG.max_running
        assert served_by() == other
    finally:
        for http, response, _ in opened:
            response.close()
            http.close()
    _wait_for(lambda: server.metrics()["perfx_requests_running"] == 0, 60, "the streams' slots freed")
    assert served_by() == affine


def test_foreign_hosts_and_bodies_not_sent_as_json_are_refused_at_the_ingress(server):
    """The ingress applies the single server's guard before a replica is chosen: a Host that is not a loopback name
    (DNS rebinding) is 421, a body sent as text/plain (a cross-site form) 415. Bodies that are JSON only in name
    (nesting past the parser's depth, a 5000-digit number, a lone surrogate) get through the ingress's prefix key
    to a replica's 400, as on one server (tests/test_serving_hostile.py)."""

    def post(content: bytes, content_type: str = "application/json", host: str | None = None) -> httpx.Response:
        headers = {**server.headers, "Content-Type": content_type} | ({"Host": host} if host else {})
        return httpx.post(server.url + "/v1/completions", content=content, headers=headers, timeout=60)

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    port = server.url.rsplit(":", 1)[1]
    for host in (None, f"localhost:{port}", "[::1]"):
        response = post(body, host=host)
        assert response.status_code == 200, (host, response.text)
        assert response.headers["x-perfx-replica"] in server.replicas()
    for response, status, code in (
        (post(body, host="attacker.example"), 421, "host_not_allowed"),
        (post(body, host=f"attacker.example:{port}"), 421, "host_not_allowed"),
        (post(body, content_type="text/plain"), 415, "unsupported_media_type"),
    ):
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code and response.headers["x-perfx-replica"] == "ingress"
    for content, message in (
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", "unreadable number"),
        (b'{"prompt": "\\ud800"}', "surrogate"),
    ):
        response = post(content)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
        assert response.headers["x-perfx-replica"] in server.replicas()


def test_metrics_add_up_across_replicas(server):
    before = server.metrics()
    served = set()
    for i in range(6):
        body = {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
        assert response.status_code == 200, response.text
        served.add(response.headers["x-perfx-replica"])
    after = server.metrics()
    finished = 'perfx_requests_finished_total{finish_reason="length"}'
    assert after[finished] - before.get(finished, 0) == 6
    assert after["perfx_generation_tokens_total"] - before["perfx_generation_tokens_total"] == 18
    assert after["perfx_replicas"] == 2 and after["perfx_kv_cache_slots_total"] == 2 * CONFIG.max_running
    assert served <= set(server.replicas())
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.json()["replicas"] == 2 and set(health.headers["x-perfx-replica"].split(",")) == set(
        server.replicas()
    )


def test_a_replica_killed_mid_stream(server):
    """SIGKILL the process of the replica three streams are on: those streams end with an error event at once, a
    new request (which would have gone there) is served by the other replica, /health stays 200, and Ray starts
    a replacement."""
    replicas = server.replicas()
    body = {"model": MODEL, "prompt": "A long story about the sea, told slowly:", "max_tokens": 300}
    body["ignore_eos"] = True
    victim = rank_by_affinity(prefix_key("/v1/completions", json.dumps(body).encode()), list(replicas))[0]
    survivor = next(r for r in replicas if r != victim)
    streams: dict[int, tuple] = {}
    first = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server, body, streams, i, first[i])) for i in range(3)]
    for t in threads:
        t.start()
    for event in first:
        assert event.wait(120), "a stream did not start"
    health: list = []
    replaced = threading.Event()

    def poll_health() -> None:
        while not replaced.is_set():
            try:
                health.append(httpx.get(server.url + "/health", timeout=10).status_code)
            except httpx.TransportError as exc:
                health.append(repr(exc))
            time.sleep(0.2)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        os.kill(replicas[victim], signal.SIGKILL)
        killed = time.monotonic()
        response = httpx.post(
            server.url + "/v1/completions", json={**body, "max_tokens": 4}, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-perfx-replica"] == survivor and time.monotonic() - killed < 15
        for t in threads:
            t.join(60)
        assert sorted(streams) == [0, 1, 2]
        for status, replica, lines, _ in streams.values():
            assert status == 200 and replica == victim
            assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "replica_failed"
            assert len(lines) < 300  # cut short, not finished
        assert all(ended - killed < 30 for *_, ended in streams.values())  # ended at once, not at a timeout
        new = _wait_for(lambda: set(server.replicas()) - set(replicas), 180, "a replacement replica")
        assert len(server.replicas()) == 2 and survivor in server.replicas() and len(new) == 1
    finally:
        replaced.set()
        poller.join(30)
    assert health and set(health) == {200}, health
    assert server.metrics()['perfx_ingress_replica_failures_total{stage="streaming"}'] == 3


def test_scaling_from_one_to_two_and_back_under_load_loses_nothing(server):
    """Autoscaled on ongoing requests (min 1, max 2, target 2 per replica): four clients bring up a second
    replica, then one client alone lets it go, drained. Every request is answered once and whole."""
    settings = ReplicaSettings(
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        cpus=0.5,
        env=REPLICA_ENV,
        autoscaling={"upscale_delay_s": 0, "downscale_delay_s": 2, "look_back_period_s": 1},
    )
    _deploy(settings)
    _wait_for(lambda: server.metrics().get("perfx_replicas") == 1, 120, "scaling down to one replica while idle")
    before = server.metrics()
    results: dict[tuple[int, int], tuple] = {}
    sent: list[tuple[int, int]] = []
    served_by: set[str] = set()  # replica headers of the answers so far
    busy, stop = threading.Event(), threading.Event()
    busy.set()

    def load(worker: int) -> None:
        for n in range(1000):
            if stop.is_set() or (worker > 0 and not busy.is_set()):
                return
            body = {"model": MODEL, "prompt": f"Client {worker}, request {n}:", "max_tokens": 16, "ignore_eos": True}
            body["stream_options"] = {"include_usage": True}
            sent.append((worker, n))
            _stream(server, body, results, (worker, n))
            status, replica, _, _ = results[(worker, n)]
            if status == 200:
                served_by.add(replica)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    try:
        _wait_for(lambda: server.metrics().get("perfx_replicas") == 2, 150, "scaling up to two replicas", every=0.5)
        # Serve lists the new replica before every router sends it requests: the load stays until it has served.
        _wait_for(lambda: len(served_by) == 2, 60, "the second replica serving", every=0.2)
        busy.clear()  # three clients stop after their current request
        _wait_for(lambda: server.metrics().get("perfx_replicas") == 1, 150, "scaling down to one", every=0.5)
        time.sleep(1)  # the last client keeps sending to the one replica left
    finally:
        stop.set()
        for w in workers:
            w.join(180)
    after = server.metrics()
    assert sorted(results) == sorted(sent) and len(sent) >= 8  # every request sent came back
    for status, _, lines, _ in results.values():
        assert status == 200 and lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in c for c in chunks) and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert len({replica for _, replica, _, _ in results.values()}) == 2  # the second replica served some
    for name in ("perfx_ingress_retries_total", 'perfx_ingress_replica_failures_total{stage="streaming"}'):
        assert after.get(name, 0) == before.get(name, 0), name  # nothing cut short, nothing sent twice


def test_429_once_every_replica_queue_is_full(server):
    """As on one server (test_serving.test_full_queue_is_429), on two replicas of --max-running 1 --max-queue 1:
    two streams run (the second finds its prefix's replica full and takes the other), two wait (one on each), and
    the next request is refused with 429 queue_full by a replica, not held in Ray's queues."""
    _deploy(TWO, replace(CONFIG, max_running=1, max_queue=1))
    _wait_for(
        lambda: (m := server.metrics()).get("perfx_replicas") == 2 and m["perfx_kv_cache_slots_total"] == 2,
        120,
        "two replicas of one slot each",
    )
    replicas = server.replicas()
    opened = []
    try:
        opened += [_streaming_request(server) for _ in range(2)]  # run
        opened += [_streaming_request(server, wait_first_token=False) for _ in range(2)]  # wait for a slot
        assert sorted(response.headers["x-perfx-replica"] for _, response, _ in opened) == sorted(2 * list(replicas))
        response = httpx.post(
            server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, headers=server.headers, timeout=20
        )
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "queue_full" and response.headers["x-perfx-replica"] in replicas
        metrics = server.metrics()
        for replica in replicas:
            assert metrics[f'perfx_replica_requests_running{{replica="{replica}"}}'] == 1
            assert metrics[f'perfx_replica_requests_waiting{{replica="{replica}"}}'] == 1
    finally:
        for http, response, _ in opened:
            response.close()
            http.close()


def test_the_command_joins_the_cluster_and_leaves_it_on_sigint(server):
    """`perfx serve --ray --ray-address ...` from another process deploys into the running cluster (its Serve
    keeps the port it has), with its --allowed-hosts in place of the loopback names, and removes its application
    on Ctrl-C."""
    address = ray.get_runtime_context().gcs_address
    port = server.url.rsplit(":", 1)[1]
    command = [sys.executable, "-m", "perfx_core.serving", "--ray", "--ray-address", address, "--port", port]
    command += ["--replicas", "1", "--replica-cpus", "0.5", "--context", "256", "--max-running", "2"]
    command += ["--allowed-hosts", "perfx.internal,127.0.0.1"]
    # This process's environment as Ray left it (its token authentication mode), less the API key.
    env = {k: v for k, v in os.environ.items() if k != "PERFX_API_KEY"} | REPLICA_ENV
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if line.startswith("perfx: serving"):
                ready.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert ready.wait(180), "".join(lines[-30:])
        models = httpx.get(server.url + "/v1/models", timeout=30)  # the command's deployment: no API key
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 256
        assert models.headers["x-perfx-replica"] in server.replicas()
        named = httpx.get(server.url + "/v1/models", headers={"Host": "perfx.internal"}, timeout=30)
        assert named.status_code == 200 and named.headers["x-perfx-replica"] in server.replicas()
        default = httpx.get(server.url + "/v1/models", headers={"Host": "localhost"}, timeout=30)
        assert default.status_code == 421  # a loopback default, replaced by the list
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(10)
    assert APP_NAME not in serve.status().applications
