"""Load: 64 concurrent streaming chats for a bounded time on the tiny model; every stream complete and well formed,
no errors, and nothing left behind (requests, queue entries, cache rows) — checked on /metrics, which must parse
as Prometheus text and carry the SERVING.md metric names."""

import json
import random
import socket
import threading
import time

import pytest

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

STREAMS = 64
SECONDS = 6.0

SERVING_METRICS = [
    "kestrel:num_requests_running", "kestrel:num_requests_waiting", "kestrel:kv_cache_usage_perc",
    "kestrel:prefix_cache_queries", "kestrel:prefix_cache_hits", "kestrel:prompt_tokens",
    "kestrel:generation_tokens", "kestrel:request_success", "kestrel:time_to_first_token_seconds",
    "kestrel:inter_token_latency_seconds", "kestrel:e2e_request_latency_seconds",
    "kestrel:request_queue_time_seconds",
]


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--max-num-seqs", 32)  # more streams than sequences: some always wait
    yield s
    assert s.stop() == 0


def read_http_stream(sock):
    """Reads a chunked HTTP response to its end; returns (status line, headers, body bytes)."""
    f = sock.makefile("rb")
    status = f.readline().decode().strip()
    headers = {}
    while (line := f.readline().decode().strip()):
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int(f.readline().strip(), 16)
            if size == 0:
                f.readline()
                break
            body += f.read(size)
            assert f.read(2) == b"\r\n"
    else:
        body = f.read(int(headers.get("content-length", 0)))
    return status, headers, body


def one_stream(port, rng):
    max_tokens = rng.randint(4, 40)
    # One of four long system prompts (a few hundred tokens): later requests find them in the prefix cache.
    k = rng.randint(1, 4)
    shared = " ".join(f"Rule {i} of assistant {k}: answer briefly." for i in range(30))
    body = json.dumps({"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": shared},
                                    {"role": "user", "content": f"question {rng.random()}"}]})
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        status, headers, raw = read_http_stream(s)
    assert status == "HTTP/1.1 200 OK", status
    assert headers["content-type"] == "text/event-stream"
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == max_tokens
    return usage


def test_64_concurrent_streams_for_a_bounded_time(server):
    before = server.wait_idle()
    deadline = time.time() + SECONDS
    done, errors = [], []
    lock = threading.Lock()

    def worker(i):
        rng = random.Random(i)
        while time.time() < deadline:
            try:
                u = one_stream(server.port, rng)
                with lock:
                    done.append(u)
            except Exception as e:  # noqa: BLE001 (reported below)
                with lock:
                    errors.append(repr(e))
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 120)
    assert not errors, errors[:5]
    assert len(done) >= STREAMS

    after = server.wait_idle()
    n = len(done)
    stop = ("kestrel:request_success_total", ("finished_reason", "length"))
    assert after[stop] - before[stop] == n
    assert after["kestrel:generation_tokens_total"] - before["kestrel:generation_tokens_total"] == \
        sum(u["completion_tokens"] for u in done)
    assert after["kestrel:prompt_tokens_total"] - before["kestrel:prompt_tokens_total"] == \
        sum(u["prompt_tokens"] for u in done)
    assert after["kestrel:e2e_request_latency_seconds_count"] - before["kestrel:e2e_request_latency_seconds_count"] == n
    hits = after["kestrel:prefix_cache_hits_total"] - before["kestrel:prefix_cache_hits_total"]
    assert hits > 0 and hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in done)
    assert after["kestrel:num_requests_running"] == 0 and after["kestrel:kv_cache_usage_perc"] == 0


def test_metrics_parse_as_prometheus_text_with_the_serving_names(server):
    from prometheus_client.parser import text_string_to_metric_families
    h.post(server.url + "/v1/completions", {"prompt": "warm", "max_tokens": 3, "ignore_eos": True})
    _, text = server.get("/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in SERVING_METRICS:
        assert name in fams, name
        for s in fams[name].samples:
            assert s.labels["model_name"] == "tiny"
    assert fams["kestrel:time_to_first_token_seconds"].type == "histogram"
    assert fams["kestrel:prompt_tokens"].type == "counter"
    assert fams["kestrel:num_requests_running"].type == "gauge"
    reasons = {s.labels["finished_reason"] for s in fams["kestrel:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    # Buckets are cumulative and end with the count.
    buckets = [s for s in fams["kestrel:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    values = [s.value for s in buckets]
    assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf"
    count = [s for s in fams["kestrel:e2e_request_latency_seconds"].samples if s.name.endswith("_count")][0]
    assert count.value == values[-1] >= 1
