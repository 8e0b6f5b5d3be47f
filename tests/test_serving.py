"""`perfx serve` end to end: a real server process on localhost serving the real SmolLM2 model.

The servers (and the greedy reference run) disable the optional CPU plugins (lowmem-int4, numba-cpu): on the
2-core test machine they make prefill seconds slower (numba-cpu's batched decode too), and the reference must
run the same kernels as the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

API_KEY = "test-key"
CONTEXT = 512
PROMPT = "The capital of France is"
PROMPT_TOKENS = 5
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_TOKENS = 8
SERVER_ENV = {k: v for k, v in os.environ.items() if k != "PERFX_API_KEY"}
SERVER_ENV["PERFX_DISABLE_PLUGINS"] = "lowmem-int4,numba-cpu"
# One BLAS thread: on a shared 2-core machine OpenBLAS's spinning worker threads make every step several times slower.
SERVER_ENV["OPENBLAS_NUM_THREADS"] = "1"
REFERENCE = f"""
import json, perfx_core
m = perfx_core.load(None, context_length={CONTEXT})
print(json.dumps({{
    "completion": m.generate({PROMPT!r}, max_tokens={GREEDY_TOKENS}, temperature=0).run(),
    "chat": m.chat({CHAT!r}, max_tokens={GREEDY_TOKENS}, temperature=0).run(),
}}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *options: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "perfx_core.serving",
                "--port",
                str(self.port),
                "--context",
                str(CONTEXT),
                "--log-level",
                "warning",
                *options,
            ],
            env=SERVER_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 60) -> Server:
        deadline = time.monotonic() + timeout
        saw_503 = False
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
                saw_503 |= status == 503
                if status == 200:
                    self.saw_loading = saw_503
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become healthy")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    headers: dict[str, str] = {}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run_reference(script: str, payload) -> object:
    """Run ``script`` (Python printing JSON) with ``payload`` as JSON in argv[1], in a process with the servers'
    kernels and environment; its parsed output."""
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(payload)], env=SERVER_ENV, capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


def serve(*options: str):
    """A started server on the bundled model, stopped when the generator is closed (a fixture's body)."""
    srv = Server(*options)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def client_and_model(server) -> tuple:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference():
    process = subprocess.Popen([sys.executable, "-c", REFERENCE], env=SERVER_ENV, stdout=subprocess.PIPE, text=True)
    yield process
    process.kill()


@pytest.fixture(scope="module")
def server(reference):
    srv = Server("--max-running", "4", "--max-queue", "8", "--api-key", API_KEY)
    srv.headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def greedy(reference):
    out, _ = reference.communicate(timeout=120)
    return json.loads(out)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _post(server, path, body, headers=None, timeout=60):
    return httpx.post(server.url + path, json=body, headers=headers or server.headers, timeout=timeout)


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_health_is_503_while_loading_then_models_lists_the_model(server, client):
    assert server.saw_loading
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_greedy_completion_equals_generate(server, client, greedy):
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0
    )
    assert result.choices[0].text == greedy["completion"]
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage.completion_tokens <= GREEDY_TOKENS and result.usage.prompt_tokens == PROMPT_TOKENS


def test_streamed_completion_with_usage(client, greedy):
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt=PROMPT,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy["completion"]
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.total_tokens == PROMPT_TOKENS + chunks[-1].usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed_equal_generate(client, greedy):
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=CHAT, max_completion_tokens=GREEDY_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == greedy["chat"]
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=CHAT,
            max_tokens=GREEDY_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy["chat"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_ends_with_stop(client, greedy):
    word = greedy["completion"].split()[1]
    result = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0, stop=[word]
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == greedy["completion"][: greedy["completion"].index(word)]


def test_four_concurrent_streams_are_decoded_in_one_batch(server, client):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            prompt=f"Story number {i}:",
            max_tokens=16,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        results[i] = list(stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(chunks[-1].usage.completion_tokens == 16 for chunks in results.values())
    metrics = server.metrics()
    assert metrics["perfx_max_decode_batch_size"] == 4
    assert metrics["perfx_kv_cache_slots_total"] == 4
    # Engine time per step kind (the server is shared by the module's tests: at least this test's steps).
    assert metrics['perfx_engine_step_seconds_count{kind="decode"}'] >= 15
    assert metrics['perfx_engine_step_seconds_sum{kind="decode"}'] > 0
    assert metrics['perfx_engine_step_seconds_count{kind="prefill"}'] >= 4


def test_load_generator_measures_a_real_server(server):
    """benchmarks/bench_serving.py against this server: every request of each level completes with its tokens, the
    gaps and the server's own histogram are read, and concurrency 2 is spread over 2 client processes. It only
    targets loopback addresses, and stops at once when its first request is refused (a wrong API key)."""
    bench = [sys.executable, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_serving.py")]
    run = subprocess.run(
        [*bench, "--url", server.url, "--api-key", API_KEY, "--concurrency", "1,2", "--requests", "2"]
        + ["--max-tokens", "4", "--client-processes", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    levels = json.loads(run.stdout)["levels"]
    assert [(r["concurrency"], r["client_processes"], r["requests"], r["failed"]) for r in levels] == [
        (1, 1, 2, 0),
        (2, 2, 2, 0),
    ]
    for r in levels:
        assert r["output_tokens_per_s"] > 0 and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert r["server_itl_ms_p50"] > 0 and r["steps"]["decode"]["count"] >= 3  # 4 tokens: 3 decode steps at least
    refused = subprocess.run([*bench, "--url", "http://example.com:8000"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "loopback" in refused.stderr
    bad_key = subprocess.run(
        [*bench, "--url", server.url, "--api-key", "wrong"], capture_output=True, text=True, timeout=60
    )
    assert bad_key.returncode == 1 and "the first request failed: HTTP 401" in bad_key.stderr


def test_context_overflow_names_both_numbers(server):
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 600})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        f"{PROMPT_TOKENS} tokens" in error["message"] and "600" in error["message"] and str(CONTEXT) in error["message"]
    )
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "n": 5}, "n"),  # more choices than the server's 4 slots
        ("/v1/completions", {"prompt": PROMPT, "model": 4}, "model"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ],
)
def test_bad_parameters_are_400_with_openai_error(server, path, body, param):
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_is_400(server):
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/v1/models", "/metrics"):
            response = httpx.get(server.url + path, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
    assert _post(server, "/v1/completions", {"prompt": PROMPT}, headers={"X": "y"}).status_code == 401


def test_body_over_one_mib_is_413(server):
    response = _post(server, "/v1/completions", {"prompt": "a" * (1 << 20)})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def _streaming_request(server, wait_first_token=True, **body):
    """Open a long streaming completion (reading its first token unless told not to).

    Returns (client, response, line iterator); keep all three alive until done: a dropped iterator can close
    the connection when it is garbage-collected, which the server rightly treats as a disconnect.
    """
    http = httpx.Client(timeout=30, headers=server.headers)
    request = http.build_request(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True, **body},
    )
    response = http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    if wait_first_token:
        assert next(line for line in lines if line.startswith("data:"))
    return http, response, lines


def test_client_disconnect_cancels_and_frees_the_slot(server):
    http, response, _ = _streaming_request(server)
    assert server.metrics()["perfx_requests_running"] == 1
    response.close()
    http.close()

    def freed():
        m = server.metrics()
        return m["perfx_requests_running"] == 0 and m["perfx_kv_cache_slots_used"] == 0

    assert _wait_for(freed)
    assert server.metrics()['perfx_requests_finished_total{finish_reason="cancelled"}'] == 1


@pytest.mark.parametrize(
    "flags",
    [("--mixed-steps",), ("--no-mixed-steps",), (), ("--mixed-steps", "--overlap-output", "--mixed-chunk", "2")],
)
def test_prompts_joining_a_decode_give_the_greedy_text(greedy, flags):
    """With mixed steps the prompts of requests arriving while another decodes ride in its decode steps (metric
    kind "mixed"), --mixed-chunk 2 tokens at a time; without, they are prefilled between them (the default on a
    CPU, as here: no flags). With overlapped output (the default on a GPU) each step's text is sent while the
    next step runs. Every request gets generate()'s greedy text either way."""
    server = Server("--max-running", "3", *flags).wait_ready()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        first = client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(first))  # decoding now: the next prompts join its steps
        texts: dict[int, str] = {}

        def run(i: int) -> None:
            texts[i] = (
                client.completions.create(
                    model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0
                )
                .choices[0]
                .text
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        list(first)
        assert texts == {0: greedy["completion"], 1: greedy["completion"]}
        mixed = server.metrics().get('perfx_engine_step_seconds_count{kind="mixed"}', 0)
        if "--mixed-chunk" in flags:  # each of the two joining prompts in chunks of 2 tokens
            assert mixed >= 2 * -(-PROMPT_TOKENS // 2)
        else:
            assert mixed >= 1 if "--mixed-steps" in flags else mixed == 0
    finally:
        server.stop()


def test_full_queue_is_429():
    server = Server("--max-running", "1", "--max-queue", "1").wait_ready()
    opened = []
    try:
        opened.append(_streaming_request(server))  # runs
        opened.append(_streaming_request(server, wait_first_token=False))  # waits for the slot
        response = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, timeout=20)
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        assert server.metrics()["perfx_requests_waiting"] == 1
    finally:
        for http, response, _ in opened:
            response.close()
            http.close()
        server.stop()


def test_cli_errors_are_perfx_errors_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--port", str(port)], "cannot listen on"),
            ([str(tmp_path / "missing.gguf")], "does not exist"),
            (["--max-running", "0"], "argument --max-running: must be an integer >= 1"),
            (["--mixed-chunk", "0"], "argument --mixed-chunk: must be an integer >= 1"),
            (["--mixed-chunk", "65"], "mixed-chunk must be at most 64"),
        ]
        for options, message in cases:
            run = subprocess.run(
                [sys.executable, "-m", "perfx_core.serving", *options],
                env=SERVER_ENV,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 2 and message in run.stderr, run.stderr


def _counted_event_post():
    """A new event loop, an _EventPost to it, and the list its wake-ups (call_soon_threadsafe) are counted in."""
    from perfx_core.serving.app import _EventPost

    loop = asyncio.new_event_loop()
    wake_ups = []
    real_call = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wake_ups.append(1), real_call(*a))[1]
    return loop, _EventPost(loop), wake_ups


def test_held_events_wake_the_loop_once_when_released():
    """While the scheduler holds the post (handling a step's text), events queue up without waking the loop,
    whose thread would otherwise take the GIL from the scheduler mid-step; the release wakes it once for all
    of them, and a release with nothing pending wakes nobody."""
    loop, post, wake_ups = _counted_event_post()
    queues = [asyncio.Queue() for _ in range(16)]
    try:
        post.hold()
        for i, queue in enumerate(queues):
            post.post(queue, i)
        assert not wake_ups and all(queue.empty() for queue in queues)
        post.release()
        assert len(wake_ups) == 1
        loop.run_until_complete(asyncio.sleep(0))  # the loop runs the delivery
        assert [queue.get_nowait() for queue in queues] == list(range(16))
        post.hold()
        post.release()
        assert len(wake_ups) == 1
        post.post(queues[0], "not held")  # outside a hold: delivered at once
        assert len(wake_ups) == 2
    finally:
        loop.close()


def test_event_post_delivers_every_event_in_order_with_fewer_wake_ups():
    """The scheduler thread's tokens reach each request's queue in order, through one loop wake-up per burst
    instead of one per event; posting after the loop closed is silently dropped (nobody is listening)."""
    loop, post, wake_ups = _counted_event_post()
    queues = [asyncio.Queue() for _ in range(4)]

    def scheduler_thread() -> None:
        for step in range(50):  # a step emits one token to every request at once
            for i, queue in enumerate(queues):
                post.post(queue, (i, step))

    async def receive_all() -> list[list]:
        thread = threading.Thread(target=scheduler_thread)
        thread.start()
        received = [[await q.get() for _ in range(50)] for q in queues]
        thread.join()
        return received

    try:
        received = loop.run_until_complete(asyncio.wait_for(receive_all(), 30))
    finally:
        loop.close()
    assert received == [[(i, step) for step in range(50)] for i in range(4)]
    assert 1 <= len(wake_ups) < 200
    for _ in range(3):  # the loop is closed: no error in the scheduler thread, and nothing piles up
        post.post(queues[0], "late")
    assert not post._pending
