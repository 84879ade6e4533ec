"""A server that survives its users: every bad input is answered with the right OpenAI error and the server then
serves a normal request; oversized bodies, wrong API keys, clients that vanish mid-stream, 1000 requests at once,
and SIGTERM while a stream runs."""

import asyncio
import json
import resource
import signal
import socket
import threading
import time

import pytest

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

KEY = "sk-kestrel-test"


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--api-key", KEY, "--max-model-len", 512, "--max-request-bytes", 1 << 20,
                 "--max-queued-requests", 100)
    yield s
    assert s.stop() == 0


def call(server, path, body, key=KEY, **kw):
    return h.post(server.url + path, body, headers={"Authorization": f"Bearer {key}"} if key else {}, **kw)


def serves_normally(server):
    status, r = call(server, "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 3,
                                                 "ignore_eos": True})
    assert status == 200, r
    assert r["usage"]["completion_tokens"] == 3


def check_error(status, body, want_status, param=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == want_status and err["message"]
    if param is not None:
        assert err["param"] == param, err


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": "x",', None),
    ("body not an object", "/v1/completions", b'[1, 2, 3]', None),
    ("deeply nested json", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
     b'"parameters": {"a": ' + b"[" * 100000 + b"]" * 100000 + b'}}}], "tool_choice": "none"}', None),
    ("invalid utf-8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe bad"}', None),
    ("lone surrogate escape", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', None),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("n a fraction", "/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
    ("temperature a string", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("stream a string", "/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("messages a string", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("prompt missing", "/v1/completions", {"model": "tiny"}, "prompt"),
    ("stop a number", "/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 12}, "max_tokens"),
    ("max_tokens beyond int64", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 30}, "max_tokens"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("prompt too long", "/v1/completions", {"prompt": [65] * 600, "max_tokens": 1}, "prompt"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": [65] * 500, "max_tokens": 100}, "max_tokens"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("unknown role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("image content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ("unknown tool_choice", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ("tool of unknown type", "/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("auto tools without a parser", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("json_schema response_format", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("logit_bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("too many logprobs", "/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("what,path,body,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_then_normal_request(server, what, path, body, param):
    status, r = call(server, path, body)
    check_error(status, r, 400, param)
    serves_normally(server)


def test_unknown_top_level_fields_are_ignored_as_vllm_does(server):
    status, r = call(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": 1})
    assert status == 200 and r["usage"]["completion_tokens"] <= 2
    # The server's stderr is read by another thread: the line may arrive just after the response.
    deadline = time.monotonic() + 5
    while not any("frobnicate" in line for line in server.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("frobnicate" in line for line in server.log)


def test_unknown_model_and_route(server):
    check_error(*call(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model")
    check_error(*call(server, "/v1/nowhere", {}), 404)
    serves_normally(server)


def test_wrong_api_key(server):
    check_error(*call(server, "/v1/completions", {"prompt": "x"}, key="sk-wrong"), 401)
    check_error(*call(server, "/v1/completions", {"prompt": "x"}, key=None), 401)
    assert server.get("/health")[0] == 200  # health and metrics need no key, as in vLLM
    serves_normally(server)


def test_body_over_the_limit(server):
    big = b'{"prompt": "' + b"a" * (100 << 20) + b'"}'
    check_error(*call(server, "/v1/completions", big, timeout=120), 413)
    serves_normally(server)


def test_body_over_the_limit_without_length(server):
    # Chunked transfer: the size is known only while reading.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n".encode())
        chunk = b"a" * (256 << 10)
        try:
            for _ in range(8):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    serves_normally(server)


def test_malformed_http_then_normal_request(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 400"), reply
    serves_normally(server)


def test_client_disconnect_mid_stream_frees_rows(server):
    before = server.wait_idle()
    body = json.dumps({"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True})
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        running = server.metrics()["kestrel:num_requests_running"]
    after = server.wait_idle()
    assert running == 1
    aborted = ("kestrel:request_success_total", ("finished_reason", "abort"))
    assert after[aborted] == before[aborted] + 1
    generated = after["kestrel:generation_tokens_total"] - before["kestrel:generation_tokens_total"]
    assert 3 <= generated < 400
    serves_normally(server)


def test_thousand_requests_at_once(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))

    async def one(i):
        body = json.dumps({"model": "tiny", "prompt": f"request {i}", "max_tokens": 4, "ignore_eos": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Connection: close\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                      f"{body}").encode())
        await writer.drain()
        raw = await reader.read()
        writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(payload)

    async def all_at_once():
        return await asyncio.gather(*(one(i) for i in range(1000)))

    results = asyncio.run(all_at_once())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    ok = [b for s, b in results if s == 200]
    assert len(ok) >= 100  # at least a queue's worth is served
    assert all(b["usage"]["completion_tokens"] == 4 for b in ok)
    for s, b in results:
        if s == 429:
            check_error(s, b, 429)
    m = server.wait_idle()
    assert m.get(("kestrel:request_rejected_total", ("status", "429")), 0) == statuses.count(429)
    serves_normally(server)


def open_stream(port, max_tokens):
    """A streaming completion on a raw socket, read up to its first event; the caller closes the socket."""
    body = json.dumps({"model": "tiny", "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True})
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    return s


def test_full_queue_answers_429(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--max-queued-requests", 2)
    try:
        streams = [open_stream(s.port, 3000) for _ in range(2)]
        status, r = h.post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        check_error(status, r, 429)
        for c in streams:
            c.close()
        s.wait_idle()
        status, r = h.post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert status == 200 and r["usage"]["completion_tokens"] == 2
    finally:
        assert s.stop() == 0


def test_sigterm_lets_running_streams_finish(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir)
    events, first = [], threading.Event()

    def stream():
        body = json.dumps({"model": "tiny", "prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True})
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as c:
            c.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            raw = b""
            while True:
                part = c.recv(65536)
                if not part:
                    break
                raw += part
                if b"data: " in raw:
                    first.set()
        events.extend(line for line in raw.decode().split("\n") if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        status, r = h.post(s.url + "/v1/completions", {"prompt": "late", "max_tokens": 2}) \
            if s.proc.poll() is None else (503, {"error": {"code": 503}})
        assert status == 503
        t.join(60)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    text_chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["choices"][0]["finish_reason"] in (None, "length") for c in text_chunks)
