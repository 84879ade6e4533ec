"""Issue 21: inputs that crashed, hung or got a 500 from `kestrel serve` before. Each test asserts values: the
status and error of the answer, the exit code and message of a refused start, what the HTTP layer sent."""

import json
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

import test_server_harness as h
from kestrel_binary import kestrel_bin
from test_server_harness import tiny_dir  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--max-model-len", 512)
    yield s
    assert s.stop() == 0


def raw_post(port, path, body: bytes, version="1.1"):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall((f"POST {path} HTTP/{version}\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        raw = b""
        while True:
            part = c.recv(65536)
            if not part:
                break
            raw += part
    head, _, payload = raw.partition(b"\r\n\r\n")
    return head.decode(), payload


# Each got a 500 before (an uncaught nlohmann exception in the handler).
FIVE_HUNDREDS = [
    ("max_tokens 1e400", b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', None),
    ("tools[0].type a number", json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                           "tools": [{"type": 5, "function": {"name": "f"}}]}).encode(), "tools[0]"),
    ("tool_choice type a list", json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                            "tools": [{"type": "function", "function": {"name": "f"}}],
                                            "tool_choice": {"type": [1], "function": {"name": "f"}}}).encode(),
     "tool_choice"),
    ("response_format type a number", json.dumps({"model": "tiny", "prompt": "x",
                                                  "response_format": {"type": 7}}).encode(), None),
]


@pytest.mark.parametrize("what,body,param", FIVE_HUNDREDS, ids=[c[0] for c in FIVE_HUNDREDS])
def test_wrong_types_are_400_not_500(server, what, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, r = h.post(server.url + path, body)
    assert status == 400, r
    assert r["error"]["type"] == "BadRequestError"
    if param:
        assert r["error"]["param"] == param
    m = server.metrics()
    assert m[("kestrel:http_requests_total", ("status", "500"))] == 0
    assert m[("kestrel:http_requests_total", ("status", "400"))] >= 1


def test_prompt_far_over_the_context_is_refused_before_tokenising(server):
    # 512 tokens of max_model_len; a token of the tiny tokenizer is a few bytes at most, so 2 MB cannot fit.
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "ab " * 700000, "max_tokens": 1})
    assert status == 400
    assert "bytes long, which is more than 512 tokens" in r["error"]["message"]
    status, r = h.post(server.url + "/v1/chat/completions",
                       {"model": "tiny", "messages": [{"role": "user", "content": "ab " * 700000}], "max_tokens": 1})
    assert status == 400
    assert "bytes long" in r["error"]["message"]
    # /v1/score_tokens tokenised such a prompt (and its response) whole before counting its tokens.
    for body in [{"model": "tiny", "prompt": "ab " * 700000},
                 {"model": "tiny", "prompt": "x", "response": "ab " * 700000}]:
        status, r = h.post(server.url + "/v1/score_tokens", body)
        assert status == 400, r
        assert "bytes long, which is more than 512 tokens" in r["error"]["message"]
        assert r["error"]["param"] == ("response" if "response" in body else "prompt")


def test_http10_stream_is_not_chunked(server):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True}).encode()
    head, payload = raw_post(server.port, "/v1/completions", body, version="1.0")
    assert head.startswith("HTTP/1.0 200")
    assert "transfer-encoding" not in head.lower()
    events = [line for line in payload.decode().split("\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    head11, _ = raw_post(server.port, "/v1/completions", body)
    assert "transfer-encoding: chunked" in head11.lower()


def test_idle_connections_do_not_exhaust_max_connections(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--max-connections", 4, "--timeout-keep-alive", 1)
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=30) for _ in range(4)]
        # Each idle socket is closed by the server (recv returns b"" at its close; 30 s would be a failure).
        for c in idle:
            assert c.recv(100) == b""
            c.close()
        assert s.get("/health")[0] == 200
    finally:
        assert s.stop() == 0


def test_slow_header_is_closed(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--http-header-timeout", 1)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            raw = b""
            while True:
                part = c.recv(4096)
                if not part:
                    break
                raw += part
        assert raw == b""  # closed by the server (the 30 s socket timeout would raise instead); it held 300 s before
        assert s.get("/health")[0] == 200
    finally:
        assert s.stop() == 0


def test_health_is_503_while_draining(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--shutdown-timeout", 60)
    first = threading.Event()
    done = threading.Event()

    def stream():
        body = json.dumps({"model": "tiny", "prompt": "long", "max_tokens": 3000, "ignore_eos": True,
                           "stream": True})
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as c:
            c.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            c.recv(4096)
            first.set()
            # A slow reader keeps the request running while the server drains.
            done.wait(60)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(30)
        assert s.get("/health")[0] == 200
        s.proc.send_signal(signal.SIGTERM)
        status = None
        for _ in range(200):
            try:
                status = s.get("/health")[0]
            except h.urllib.error.HTTPError as e:
                status = e.code
            if status == 503:
                break
            time.sleep(0.02)
        assert status == 503
    finally:
        done.set()
        t.join(60)
        s.stop()


def test_slow_template_does_not_block_health_and_sigterm_cancels_it(tiny_dir, tmp_path):  # noqa: F811
    # A template that runs until its step budget (millions of loop iterations): seconds of work.
    tmpl = tmp_path / "slow.jinja"
    tmpl.write_text("{% for i in range(5000000) %}{% set s = i ~ 'abc' %}{% endfor %}{{ messages[0].content }}")
    s = h.Server(tiny_dir, "--chat-template", tmpl, "--http-threads", 1)
    result = {}

    def chat():
        result["status"], result["body"] = h.post(s.url + "/v1/chat/completions",
                                                  {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        result["done"] = time.monotonic()

    try:
        t = threading.Thread(target=chat)
        t.start()
        time.sleep(0.1)
        # With one HTTP thread, /health waited for the render before (it ran on that thread).
        assert s.get("/health")[0] == 200
        health_done = time.monotonic()
        t.join(120)
        assert health_done < result["done"]
        assert result["status"] == 400
        assert "budget" in result["body"]["error"]["message"]
        # A render cut by SIGTERM answers 503 at once (it was left to finish before).
        t = threading.Thread(target=chat)
        t.start()
        time.sleep(0.2)
        sigterm = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert result["status"] == 503, result
        # And the process exits promptly (it outlived SIGTERM by 45 s before: the render ran to its end).
        assert s.proc.wait(30) == 0
        assert time.monotonic() - sigterm < 5, time.monotonic() - sigterm
    finally:
        s.stop()


def refusal(model_dir, *cmd):
    p = subprocess.run([kestrel_bin(), *cmd, str(model_dir), *([] if cmd[0] == "serve" else ["--prompt", "x"])],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr


@pytest.mark.parametrize("edit,needle", [
    (lambda j: j.update(model=[1, 2]), "'model' must be an object"),
    (lambda j: j["added_tokens"].append({"id": 1000000000, "content": "<|huge|>", "special": True}),
     "token id 1000000000 is far beyond"),
], ids=["model an array", "added token id 1e9"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_broken_tokenizer_is_a_clear_error(tiny_dir, tmp_path, edit, needle, command):  # noqa: F811
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    edit(tj)
    (d / "tokenizer.json").write_text(json.dumps(tj))
    rc, err = refusal(d, command)
    assert rc == 1, err  # was SIGABRT (-6)
    assert needle in err


def test_huge_layer_count_is_refused_before_allocating(tiny_dir, tmp_path):  # noqa: F811
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 1000000000
    (d / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([kestrel_bin(), "generate", str(d), "--prompt", "x"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1
    assert "'num_hidden_layers' is too large (1000000000; at most 1024)" in p.stderr


def test_client_leaving_cancels_its_render(tiny_dir, tmp_path):  # noqa: F811
    tmpl = tmp_path / "slow.jinja"
    tmpl.write_text("{% for i in range(5000000) %}{% set s = i ~ 'abc' %}{% endfor %}{{ messages[0].content }}")
    s = h.Server(tiny_dir, "--chat-template", tmpl, "--text-threads", 1)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    quick = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    try:
        # How long a whole render takes here (it ends at its step budget).
        t0 = time.monotonic()
        status, _ = h.post(s.url + "/v1/chat/completions", chat)
        full = time.monotonic() - t0
        assert status == 400
        # A client that leaves 0.1 s into its render: the one text thread is free again at once, so a request
        # queued behind it is served long before the render would have ended (it waited for all of it before).
        body = json.dumps(chat).encode()
        c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        c.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        time.sleep(0.1)
        c.close()
        t0 = time.monotonic()
        status, r = h.post(s.url + "/v1/completions", quick)
        waited = time.monotonic() - t0
        assert status == 200, r
        assert waited < full / 2, (waited, full)
    finally:
        assert s.stop() == 0


def test_objects_of_many_keys_are_refused(server):
    # chat_template_kwargs of 5000 keys: parsing such an object costs quadratic time; it is refused while read.
    kwargs = {f"k{i}": i for i in range(5000)}
    status, r = h.post(server.url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user",
                                                            "content": "x"}], "chat_template_kwargs": kwargs})
    assert status == 400
    assert "more than 1024 keys" in r["error"]["message"]
    status, r = h.post(server.url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "chat_template_kwargs": {f"k{i}": i for i in range(1000)}})
    assert status == 200, r


def test_slow_body_is_closed(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--http-header-timeout", 1, "--http-body-min-rate", 1000)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            # 10 bytes of a 1 MB body, then silence: at 1000 bytes/s after 1 s of grace it cannot make it.
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000\r\n\r\n{\"prompt\":")
            assert c.recv(4096) == b""  # closed (a 30 s socket timeout would raise; it waited 300 s before)
        assert s.get("/health")[0] == 200
    finally:
        assert s.stop() == 0


def test_full_text_queue_answers_429(tiny_dir, tmp_path):  # noqa: F811
    tmpl = tmp_path / "slow.jinja"
    tmpl.write_text("{% for i in range(5000000) %}{% set s = i ~ 'abc' %}{% endfor %}{{ messages[0].content }}")
    s = h.Server(tiny_dir, "--chat-template", tmpl, "--text-threads", 1, "--max-text-queue", 1)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    results = []
    try:
        # One render runs, one waits in the queue of 1; a third is refused at once.
        threads = [threading.Thread(target=lambda: results.append(h.post(s.url + "/v1/chat/completions", chat)))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        status, r = h.post(s.url + "/v1/chat/completions", chat)
        assert status == 429, r
        assert r["error"]["type"] == "RateLimitError"
        for t in threads:
            t.join(120)
        assert sorted(st for st, _ in results) == [400, 400]  # both rendered to their step budget
    finally:
        assert s.stop() == 0


def test_large_detokenize_does_not_hold_up_health(tiny_dir):  # noqa: F811
    # /detokenize parsed its body and decoded its ids on the HTTP thread: with one HTTP thread, a request of three
    # million ids held /health for its whole decoding (about 0.3 s here). It runs on the text thread now.
    s = h.Server(tiny_dir, "--http-threads", 1, "--text-threads", 1)
    try:
        status, r = h.post(s.url + "/tokenize", {"model": "tiny", "prompt": "hello world "})
        assert status == 200
        unit = r["tokens"]
        reps = 3000000 // len(unit)
        body = json.dumps({"model": "tiny", "tokens": unit * reps}).encode()
        results, ends = [], []

        def detok():
            results.append(h.post(s.url + "/detokenize", body, timeout=300))
            ends.append(time.monotonic())

        senders = [threading.Thread(target=detok) for _ in range(2)]
        for t in senders:
            t.start()
        time.sleep(0.05)
        probes = []
        for _ in range(40):  # a fixed count of probes, 25 ms apart
            t0 = time.monotonic()
            assert s.get("/health")[0] == 200
            probes.append((t0, time.monotonic() - t0))
            time.sleep(0.025)
        for t in senders:
            t.join(300)
        assert [st for st, _ in results] == [200] * 2
        assert all(r["prompt"] == "hello world " * reps for _, r in results)
        # Not vacuous: the probes ran while the requests were being served.
        assert probes[0][0] < max(ends), (probes[0][0], ends)
        assert max(lat for _, lat in probes) < 0.1, sorted(lat for _, lat in probes)[-5:]
    finally:
        assert s.stop() == 0


def test_connection_and_text_work_gauges(tiny_dir, tmp_path):  # noqa: F811
    tmpl = tmp_path / "slow.jinja"
    tmpl.write_text("{% for i in range(5000000) %}{% set s = i ~ 'abc' %}{% endfor %}{{ messages[0].content }}")
    s = h.Server(tiny_dir, "--chat-template", tmpl, "--text-threads", 1)
    try:
        m = s.metrics()
        assert m["kestrel:num_open_connections"] == 1  # the /metrics request's own
        assert m["kestrel:num_text_tasks_waiting"] == 0 and m["kestrel:num_text_tasks_running"] == 0
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=30) for _ in range(3)]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
        results = []
        threads = [threading.Thread(target=lambda: results.append(h.post(s.url + "/v1/chat/completions", chat)))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        m = s.metrics()
        # 3 idle sockets, 2 chat requests (one rendering, one queued behind it) and this one.
        assert m["kestrel:num_open_connections"] == 6, m["kestrel:num_open_connections"]
        assert m["kestrel:num_text_tasks_running"] == 1
        assert m["kestrel:num_text_tasks_waiting"] == 1
        for t in threads:
            t.join(120)
        assert sorted(st for st, _ in results) == [400, 400]
        for c in idle:
            c.close()
        m = s.metrics()
        for _ in range(100):  # the server sees the closes a moment later
            if m["kestrel:num_open_connections"] == 1:
                break
            time.sleep(0.02)
            m = s.metrics()
        assert m["kestrel:num_open_connections"] == 1
        assert m["kestrel:num_text_tasks_waiting"] == 0 and m["kestrel:num_text_tasks_running"] == 0
    finally:
        assert s.stop() == 0


def test_large_answer_is_built_off_the_http_thread(tiny_dir):  # noqa: F811
    # The answer of /v1/score_tokens (each scored token and its 20 alternatives detokenised, a few MB of JSON) was
    # built on the HTTP thread: with one HTTP thread, /health waited about 0.2 s for it. Built on the text threads now
    # (as the non-streaming answers of the generation routes are).
    n, seqs = 2000, 8
    s = h.Server(tiny_dir, "--http-threads", 1, "--max-model-len", n + 16)
    try:
        prompt = [65 + i % 50 for i in range(n)]
        body = json.dumps({"model": "tiny", "prompt": [prompt] * seqs, "top_logprobs": 20}).encode()
        answer = {}

        def score():  # raw bytes: parsing megabytes of JSON here would hold the GIL the probes below need
            answer["head"], answer["body"] = raw_post(s.port, "/v1/score_tokens", body)

        t = threading.Thread(target=score)
        t.start()
        probes = []
        while t.is_alive():  # until the answer is in
            t0 = time.monotonic()
            assert s.get("/health")[0] == 200
            probes.append(time.monotonic() - t0)
            time.sleep(0.025)
        t.join()
        assert answer["head"].startswith("HTTP/1.1 200"), answer["head"]
        r = json.loads(answer["body"])
        assert [len(d["logprobs"]) for d in r["data"]] == [n - 1] * seqs
        # 20 alternatives each, keyed by their text (alternatives of the same text share a key).
        tops = [len(top) for d in r["data"] for top in d["top_logprobs"]]
        assert len(tops) == (n - 1) * seqs and max(tops) == 20 and min(tops) >= 1
        assert len(probes) > 20
        assert max(probes) < 0.1, sorted(probes)[-5:]
    finally:
        assert s.stop() == 0


def test_non_streaming_answer_after_sigterm(tiny_dir):  # noqa: F811
    # SIGTERM stops the text threads at once, but requests already running finish: the answer of one that ends
    # while the server drains is built all the same (on its HTTP thread, the text threads being gone).
    s = h.Server(tiny_dir, "--shutdown-timeout", 60, "--max-model-len", 4096)
    result = {}

    def complete():
        result["r"] = h.post(s.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1500,
                                                         "ignore_eos": True, "logprobs": 2})

    t = threading.Thread(target=complete)
    try:
        t.start()
        for _ in range(500):  # until the request runs
            if s.metrics()["kestrel:num_requests_running"] == 1:
                break
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        t.join(120)
        status, r = result["r"]
        assert status == 200, r
        assert r["usage"]["completion_tokens"] == 1500
        assert len(r["choices"][0]["logprobs"]["tokens"]) == 1500
        assert any("waiting up to 60 s for 1 running" in line for line in s.log), s.log  # it ran past the SIGTERM
    finally:
        t.join(120)
        assert s.stop() == 0
