"""Starts `kestrel serve`, waits until it answers /health, sends one streamed chat request, stops it (SIGTERM).

Prints what the real-size runs report: the time to ready (loading included), the server's peak host RSS (VmHWM),
its start-up lines (the GPU memory split), the streamed reply, and a summary line. Loopback only. Usage:
    python3 serve_once.py KESTREL_BIN MODEL_DIR PORT [kestrel serve flags...]
"""
import http.client
import json
import signal
import subprocess
import sys
import threading
import time


def vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def main() -> int:
    kestrel, model, port, *flags = sys.argv[1:]
    cmd = [kestrel, "serve", model, "--host", "127.0.0.1", "--port", port, *flags]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            print("  |", line.rstrip("\n"), flush=True)

    threading.Thread(target=pump, daemon=True).start()
    ready = None
    while time.time() - t0 < 480 and proc.poll() is None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                ready = time.time() - t0
                break
        except OSError:
            pass
        time.sleep(0.5)
    if ready is None:
        print("server did not become ready; exit code", proc.poll())
        proc.kill()
        return 1
    rss_ready = vm_hwm_kib(proc.pid)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
        "max_tokens": 24,
        "stream": True,
    }
    c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=120)
    t1 = time.time()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    chunks, text, first = 0, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {})
        if first is None:
            first = time.time() - t1
        chunks += 1
        text += delta.get("content") or ""
    total = time.time() - t1
    rss_peak = vm_hwm_kib(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed"
    print(f"reply ({r.status}, {chunks} chunks): {text!r}")
    print(json.dumps({"ready_s": round(ready, 2), "status": r.status, "chunks": chunks,
                      "first_chunk_s": round(first or -1, 3), "request_s": round(total, 3),
                      "peak_rss_gib_at_ready": round(rss_ready / 2**20, 3),
                      "peak_rss_gib": round(rss_peak / 2**20, 3), "exit": rc}))
    return 0 if r.status == 200 and chunks > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
