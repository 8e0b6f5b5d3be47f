"""Hostile requests against a real `perfx serve` while honest streams run: each one gets a clear error quickly,
and the honest streams finish unharmed.

The server serves a tiny random-weight Llama GGUF (tests/tiny_gguf.py) whose chat template loops for as long as
it is let: the chat route shows that a model file's template cannot exhaust the server.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from test_serving import Server
from tiny_gguf import write_tiny_llama_gguf

STREAMS = 3
STREAM_TOKENS = 120
# Renders until the render budget stops it: 10^10 iterations.
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "looping-template.gguf"
    write_tiny_llama_gguf(path, context_length=1024, overrides={"tokenizer.chat_template": LOOPING_TEMPLATE})
    server = Server(str(path), "--max-running", "4", "--header-timeout", "1")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _stream(server, results, i):
    body = {
        "prompt": "hello world",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, finish = 0, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:
                    finish = chunk["choices"][0]["finish_reason"] or finish
    results[i] = (response.status_code, finish, tokens)


def _post(server, body, path="/v1/completions", **kwargs):
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def _raw(server, body: bytes, content_type="application/json", host=None):
    headers = {"Content-Type": content_type}
    if host:
        headers["Host"] = host
    return httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=30)


def test_hostile_requests_leave_other_streams_unharmed(hostile_server):
    server = hostile_server
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=_stream, args=(server, results, i)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the streams are running

    def bad(response, status, param=None):
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"]
        if param:
            assert error["param"] == param
        return error

    # 1. Numbers beyond what the engine takes (top_k once overflowed int32 and ended every stream).
    bad(_post(server, {"prompt": "hi", "top_k": 2**31}), 400, "top_k")
    bad(_post(server, {"prompt": "hi", "seed": 2**70}), 400, "seed")
    bad(_post(server, {"prompt": "hi", "temperature": 1e308}), 400, "temperature")
    # 3. A chat template that would loop for hours: refused once its render budget runs out.
    started = time.monotonic()
    error = bad(_post(server, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"), 400)
    assert "render budget" in error["message"] and time.monotonic() - started < 10
    # 5. Stop strings are bounded in total length.
    bad(_post(server, {"prompt": "hi", "stop": ["x" * 9000, "y" * 9000]}), 400, "stop")
    # 6. DNS rebinding and cross-site bodies.
    assert _raw(server, b'{"prompt": "hi"}', host="attacker.example").status_code == 421
    assert _raw(server, b'{"prompt": "hi"}', content_type="text/plain").status_code == 415
    # 10. JSON that broke the parser or what reads it.
    deep = b"[" * 100_000 + b"]" * 100_000
    assert "nested deeper" in bad(_raw(server, deep), 400)["message"]
    assert bad(_raw(server, b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}"), 400)
    assert "surrogate" in bad(_raw(server, b'{"prompt": "\\ud800"}'), 400)["message"]

    for t in threads:
        t.join(120)
    assert [results[i] for i in range(STREAMS)] == [(200, "length", STREAM_TOKENS)] * STREAMS
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_chat_render_stops_when_its_client_leaves(hostile_server):
    server = hostile_server
    body = {"messages": [{"role": "user", "content": "hi"}]}
    refused = 'perfx_requests_rejected_total{status="400"}'
    refused_before = server.metrics().get(refused, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3)
    # Cancelled (499) well before the 2-second budget would have refused it (400).
    deadline = time.monotonic() + 1.5
    key = 'perfx_requests_rejected_total{status="499"}'
    while time.monotonic() < deadline and server.metrics().get(key, 0) < 1:
        time.sleep(0.05)
    assert server.metrics().get(key) == 1
    time.sleep(2)  # past the render budget: had the render gone on, it would now be a 400
    assert server.metrics().get(refused, 0) == refused_before


def test_slow_clients_are_disconnected_after_the_header_timeout(hostile_server):
    server = hostile_server
    sockets = []
    for _ in range(20):  # slowloris: headers that never end
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        sockets.append(s)
    idle = socket.create_connection(("127.0.0.1", server.port))  # connects and sends nothing
    sockets.append(idle)
    assert _post(server, {"prompt": "hi", "max_tokens": 2}).status_code == 200  # still served meanwhile
    for s in sockets:
        s.settimeout(5)
        assert s.recv(1) == b""  # closed by the server after about a second
        s.close()


def test_allowed_hosts_and_the_connection_limit(tmp_path):
    """--allowed-hosts names the Host headers answered (instead of the loopback defaults); past
    --limit-concurrency open connections a request gets 503 at once, and is served again once they close."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, context_length=1024)
    server = Server(str(path), "--limit-concurrency", "3", "--allowed-hosts", "perfx.internal,127.0.0.1")
    try:
        server.wait_ready()
        body = b'{"prompt": "hi", "max_tokens": 2}'
        assert _raw(server, body, host="perfx.internal").status_code == 200
        assert _raw(server, body, host="localhost").status_code == 421  # a default, replaced by the list
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            time.sleep(0.2)
            started = time.monotonic()
            assert _raw(server, body).status_code == 503
            assert time.monotonic() - started < 5
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        while (status := _raw(server, body).status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200
    finally:
        server.stop()
