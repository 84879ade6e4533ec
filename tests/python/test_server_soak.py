"""A bounded soak (issue 21): 64 concurrent clients, each sending a fixed list of requests (streams read whole,
streams dropped after their first event, slow readers, bad requests), while /health is polled throughout. At the
end every gauge is back at its start, the cache is empty, resident memory grew by no more than the cache pool's
pages in the first half and stayed flat in the second, and the server serves normally."""

import json
import os
import random
import socket
import threading
import time

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

CLIENTS = 64
REQUESTS_PER_CLIENT = int(os.environ.get("KESTREL_SOAK_REQUESTS", "24"))  # per client: 1536 in all


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def stream_request(port, max_tokens, mode):
    body = json.dumps({"model": "tiny", "prompt": "soak", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        c.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        raw = b""
        while True:
            part = c.recv(256 if mode == "slow" else 65536)
            if not part:
                break
            raw += part
            if mode == "drop" and b"data: " in raw:
                return "dropped"
            if mode == "slow":
                time.sleep(0.01)
    return "done" if b"data: [DONE]" in raw else "incomplete"


def test_soak(tiny_dir):  # noqa: F811
    # A cache pool of 32 MB: the pool is allocated whole but its pages are touched as rows are first used, so with
    # the default 256 MiB resident memory would climb for a long while without any leak.
    s = h.Server(tiny_dir, "--max-model-len", 256, "--kv-cache-memory-bytes", 32 << 20)
    try:
        start = s.wait_idle()
        # Warm up at full concurrency (the cache pool's pages are touched as rows are first used, allocator arenas
        # grow per thread), then take the memory baseline.
        def warm(_):
            assert stream_request(s.port, 48, "whole") == "done"
        warmers = [threading.Thread(target=warm, args=(i,)) for i in range(CLIENTS)]
        for t in warmers:
            t.start()
        for t in warmers:
            t.join(120)
        s.wait_idle()
        rss_before = rss_kb(s.proc.pid)

        stop = threading.Event()
        health = []

        def poll():
            while not stop.is_set():
                t0 = time.monotonic()
                status = s.get("/health")[0]
                health.append((status, time.monotonic() - t0))
                time.sleep(0.05)

        outcomes = []
        lock = threading.Lock()

        def client(i):
            rng = random.Random(i)
            for _ in range(REQUESTS_PER_CLIENT // 2):
                kind = rng.choice(["whole", "whole", "whole", "drop", "slow", "bad"])
                if kind == "bad":
                    status, _ = h.post(s.url + "/v1/completions", b'{"prompt": "x", "max_tokens": ')
                    result = f"bad:{status}"
                else:
                    result = stream_request(s.port, rng.randint(4, 48), kind)
                with lock:
                    outcomes.append((kind, result))

        def phase(seed):
            threads = [threading.Thread(target=client, args=(seed * CLIENTS + i,)) for i in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)

        poller = threading.Thread(target=poll)
        poller.start()
        # Two halves: the first touches every page of the cache pool, so memory that still grows in the second is
        # a leak.
        phase(0)
        s.wait_idle(timeout=60)
        rss_mid = rss_kb(s.proc.pid)
        phase(1)
        stop.set()
        poller.join(30)

        assert len(outcomes) == CLIENTS * (REQUESTS_PER_CLIENT // 2) * 2
        for kind, result in outcomes:
            assert result == {"whole": "done", "slow": "done", "drop": "dropped", "bad": "bad:400"}[kind], (kind, result)
        assert health and all(st == 200 for st, _ in health)
        # Generous: /health never waits on the engine or on text work (it answered in seconds when it did).
        assert max(lat for _, lat in health) < 2.0, max(lat for _, lat in health)

        end = s.wait_idle(timeout=60)
        for g in ["kestrel:num_requests_running", "kestrel:num_requests_waiting", "kestrel:num_requests_in_flight",
                  "kestrel:kv_cache_usage_perc"]:
            assert end[g] == start[g] == 0, g
        rss_end = rss_kb(s.proc.pid)
        assert rss_mid < rss_before + (32 << 10) + (16 << 10), (rss_before, rss_mid)  # at most the pool's pages
        assert rss_end < rss_mid * 1.05 + (4 << 10), (rss_before, rss_mid, rss_end)
        status, r = h.post(s.url + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 3,
                                                       "ignore_eos": True})
        assert status == 200 and r["usage"]["completion_tokens"] == 3
    finally:
        assert s.stop() == 0
