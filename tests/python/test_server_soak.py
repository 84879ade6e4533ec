"""A bounded soak (issue 21): 64 concurrent streams, each client sending a fixed list of requests drawn from a fixed
seed (streams read whole, streams dropped after their first event, requests cut off before their body ends, slow
readers, bad requests of several kinds), for about three minutes on a 2-core machine. /health is probed every 50 ms
by a separate process (its timings are not the test's threads' GIL) and every probe must answer 200 within 100 ms.
At the end every gauge of /metrics is back at its start, resident memory is back within 8 MB of where it started
(after a warm-up), and the server serves normally.

The load and the probe run as separate processes of this file (`python test_server_soak.py load|probe ...`); the
load runs at a lower priority than the server and the probe, as a load balancer's probe would not share a CPU with
the clients it balances."""

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

CLIENTS = 64
# Per client; a fixed count, not a time. 64 x 800 = 51200 requests: about three minutes on a 2-core machine.
REQUESTS_PER_CLIENT = int(os.environ.get("KESTREL_SOAK_REQUESTS", "800"))
SEED = 21
# Per client, before the memory baseline: enough to touch the cache pool's pages (they are touched as rows are
# first used), so that resident memory can be held to a few MB of the baseline.
WARMUP = int(os.environ.get("KESTREL_SOAK_WARMUP", "60"))
HEALTH_BUDGET = 0.100  # seconds, per probe
PROBE_EVERY = 0.050
POOL_BYTES = 32 << 20
KINDS = ["whole", "whole", "whole", "chat", "drop", "cut", "slow", "bad_json", "bad_model", "bad_method", "bad_http"]
EXPECTED = {"whole": "done", "chat": "done", "slow": "done", "drop": "dropped", "cut": "cut", "bad_json": "400",
            "bad_model": "404", "bad_method": "405", "bad_http": "400"}


# ---- the load and the probe (run as their own processes) -------------------------------------------------------

def _send(port, head, body, timeout=120):
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    c.sendall(head.encode() + body)
    return c


def _post_head(path, n):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\n\r\n")


def _read_all(c, chunk=65536, pause=0.0):
    raw = b""
    while True:
        part = c.recv(chunk)
        if not part:
            return raw
        raw += part
        if pause:
            time.sleep(pause)


def _status(raw):
    line = raw.split(b"\r\n", 1)[0].split()
    return line[1].decode() if len(line) > 1 else "none"


def _stream_usage(raw):
    """The completion_tokens of a stream's usage chunk, or None without [DONE]."""
    if b"data: [DONE]" not in raw:
        return None
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage":{' in line.replace(b" ", b""):
            u = json.loads(line[6:]).get("usage")
            if u:
                return u["completion_tokens"]
    return -1


def one_request(port, rng, kind=None):
    kind = kind or rng.choice(KINDS)
    max_tokens = rng.randint(4, 48)
    stream = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if kind == "chat":
        body = json.dumps({**stream, "messages": [{"role": "user", "content": f"soak {rng.random()}"}]}).encode()
        path = "/v1/chat/completions"
    else:
        body = json.dumps({**stream, "prompt": f"soak {rng.randint(0, 999)}"}).encode()
        path = "/v1/completions"
    if kind in ("whole", "chat", "slow"):
        with _send(port, _post_head(path, len(body)), body) as c:
            raw = _read_all(c, 256, 0.005) if kind == "slow" else _read_all(c)
        got = _stream_usage(raw)
        return kind, "done" if got == max_tokens else f"usage {got} of {max_tokens}: {raw[:200]!r}"
    if kind == "drop":  # a client that leaves after its first event
        with _send(port, _post_head(path, len(body)), body) as c:
            raw = b""
            while b"data: " not in raw:
                part = c.recv(4096)
                if not part:
                    return kind, f"closed before an event: {raw[:200]!r}"
                raw += part
        return kind, "dropped"
    if kind == "cut":  # a client that leaves halfway through its body
        c = _send(port, _post_head(path, len(body)), body[: len(body) // 2])
        c.close()
        return kind, "cut"
    if kind == "bad_json":
        bad = b'{"model": "tiny", "prompt": "x", "max_tokens": '
        with _send(port, _post_head("/v1/completions", len(bad)), bad) as c:
            return kind, _status(_read_all(c))
    if kind == "bad_model":
        bad = json.dumps({"model": "nope", "prompt": "x", "max_tokens": 2}).encode()
        with _send(port, _post_head("/v1/completions", len(bad)), bad) as c:
            return kind, _status(_read_all(c))
    if kind == "bad_method":
        with _send(port, "GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"") as c:
            return kind, _status(_read_all(c))
    with _send(port, "POST /v1/completions HTTP/1.1\r\nContent-Length: nope\r\n\r\n", b"") as c:  # bad_http
        return kind, _status(_read_all(c))


def run_load(port, clients, per_client, seed):
    """Prints one JSON line: {"outcomes": {kind: {outcome: count}}, "most_open": the most requests open at once}."""
    os.nice(10)
    outcomes = {}
    lock = threading.Lock()
    open_now = [0, 0]  # open now, most at once
    together = threading.Barrier(clients)

    def client(i):
        rng = random.Random(seed * 100003 + i)
        together.wait()
        for k in range(per_client):
            with lock:
                open_now[0] += 1
                open_now[1] = max(open_now)
            try:
                # Each client's first request a whole stream: all 64 are open at once.
                kind, result = one_request(port, rng, "whole" if k == 0 else None)
            except OSError as e:
                kind, result = "error", repr(e)
            with lock:
                open_now[0] -= 1
                outcomes.setdefault(kind, {}).setdefault(result, 0)
                outcomes[kind][result] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"outcomes": outcomes, "most_open": open_now[1]}), flush=True)


def run_probe(port):
    """Probes GET /health every PROBE_EVERY seconds on a fresh connection (as a load balancer does) until stdin
    closes; then prints one JSON line: [[status, seconds], ...]."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    results = []
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status = _status(_read_all(c))
        except OSError as e:
            status = repr(e)
        results.append([status, time.monotonic() - t0])
        time.sleep(max(0.0, PROBE_EVERY - (time.monotonic() - t0)))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "load":
        run_load(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        run_probe(int(sys.argv[2]))
    sys.exit(0)


# ---- the test ----------------------------------------------------------------------------------------------------

import test_server_harness as h  # noqa: E402
from test_server_harness import tiny_dir  # noqa: E402,F401 (fixture)


def rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def gauges(s):
    """Every gauge sample of /metrics: {(name, labels...): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    _, text = s.get("/metrics")
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "gauge":
            for smp in fam.samples:
                out[(smp.name,) + tuple(sorted(smp.labels.items()))] = smp.value
    return out


def settled_gauges(s, start, timeout=60.0):
    """The gauges once they equal `start` (connections close and streams end a little after their clients left);
    after `timeout` the last reading, which the caller's assertion then reports."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(s)
        if g == start or time.monotonic() > deadline:
            return g
        time.sleep(0.05)


def load(port, per_client, seed):
    p = subprocess.run([sys.executable, __file__, "load", str(port), str(CLIENTS), str(per_client), str(seed)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def check_outcomes(load_result, n):
    assert load_result["most_open"] == CLIENTS  # every client had a request open at one time
    outcomes = load_result["outcomes"]
    assert sum(sum(v.values()) for v in outcomes.values()) == n
    assert "error" not in outcomes, outcomes["error"]
    for kind, results in outcomes.items():
        assert list(results) == [EXPECTED[kind]], (kind, results)
    assert set(outcomes) == set(KINDS), outcomes  # every kind came up


def test_soak(tiny_dir):  # noqa: F811
    # A cache pool of 32 MB: the pool is allocated whole but its pages are touched as rows are first used, so with
    # the default 256 MiB resident memory would climb for a long while without any leak.
    s = h.Server(tiny_dir, "--max-model-len", 256, "--kv-cache-memory-bytes", POOL_BYTES)
    probe = None
    try:
        s.wait_idle()
        start = gauges(s)
        for name in ["kestrel:num_requests_running", "kestrel:num_requests_waiting", "kestrel:num_requests_in_flight",
                     "kestrel:kv_cache_usage_perc", "kestrel:num_text_tasks_waiting", "kestrel:num_text_tasks_running"]:
            assert start[(name, ("model_name", "tiny"))] == 0, name
        assert start[("kestrel:num_open_connections", ("model_name", "tiny"))] == 1  # the /metrics request's own
        # Warm up at full concurrency (the cache pool's pages are touched, allocator arenas grow per thread), then
        # take the memory baseline.
        check_outcomes(load(s.port, WARMUP, SEED + 1), CLIENTS * WARMUP)
        assert settled_gauges(s, start) == start
        rss_start = rss_kb(s.proc.pid)

        probe = subprocess.Popen([sys.executable, __file__, "probe", str(s.port)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        # Two halves: the first touches the cache pool's pages, so memory that still grows in the second is a leak.
        first = load(s.port, REQUESTS_PER_CLIENT // 2, SEED)
        assert settled_gauges(s, start) == start
        rss_mid = rss_kb(s.proc.pid)
        second = load(s.port, REQUESTS_PER_CLIENT - REQUESTS_PER_CLIENT // 2, SEED + 2)
        duration = time.monotonic() - t0
        out, _ = probe.communicate("", timeout=60)
        probe = None
        health = json.loads(out)

        check_outcomes(first, CLIENTS * (REQUESTS_PER_CLIENT // 2))
        check_outcomes(second, CLIENTS * (REQUESTS_PER_CLIENT - REQUESTS_PER_CLIENT // 2))
        assert len(health) >= duration / PROBE_EVERY / 2, (len(health), duration)
        assert all(st == "200" for st, _ in health), [st for st, _ in health if st != "200"][:5]
        worst = max(lat for _, lat in health)
        print(f"soak: {duration:.1f} s, {CLIENTS * REQUESTS_PER_CLIENT} requests, {len(health)} /health probes, "
              f"max {worst * 1000:.1f} ms; RSS {rss_start} -> {rss_mid} -> {rss_kb(s.proc.pid)} kB")
        assert worst < HEALTH_BUDGET, sorted(lat for _, lat in health)[-5:]

        end = settled_gauges(s, start)
        assert end == start, {k: (start.get(k), v) for k, v in end.items() if start.get(k) != v}
        rss_end = rss_kb(s.proc.pid)
        # Tolerance: 8 MB over the start (allocator slack; about 1 MB seen), 4 MB over the second half.
        assert rss_end < rss_start + (8 << 10), (rss_start, rss_mid, rss_end)
        assert rss_end < rss_mid + (4 << 10), (rss_start, rss_mid, rss_end)
        status, r = h.post(s.url + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 3,
                                                       "ignore_eos": True})
        assert status == 200 and r["usage"]["completion_tokens"] == 3
    finally:
        if probe is not None:
            probe.kill()
            probe.wait()
        assert s.stop() == 0
