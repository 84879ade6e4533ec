"""The serving cost of structured output against free text: one `kestrel serve`, the same batch of chat requests
sent twice per round -- free text, then with a JSON-schema `response_format` -- B at once, and the generated tokens
per second of each (completion tokens from `usage` over the wall time of the whole batch).

Both modes generate exactly --max-tokens tokens per request: free text with `ignore_eos`; the structured mode because
its schema (an object holding a list of at least 48 strings) cannot close in fewer than ~150 tokens, so the grammar
never ends a request early. They differ only by the grammar's masks and bookkeeping. A structured reply that did
finish (`finish_reason` stop, with a larger --max-tokens) is parsed and checked against the schema's shape; one cut
at max_tokens is counted as cut. Loopback only.

Usage:
    python3 structured_serve.py KESTREL_BIN MODEL_DIR PORT --batch B [--rounds R] [--max-tokens N] -- [serve flags]
Prints one JSON line per mode and round and a summary line with the cost (1 - structured / free tok/s).
"""
import argparse
import http.client
import json
import signal
import subprocess
import sys
import threading
import time

SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "minItems": 48, "items": {"type": "string", "maxLength": 8}}},
    "required": ["words"],
    "additionalProperties": False,
}


def post(port: int, body: dict) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def batch(port: int, model: str, b: int, max_tokens: int, structured: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "List some words about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 0,
    }
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}
    out: list = [None] * b
    errors: list = []

    def one(i: int) -> None:
        try:
            q = dict(body, seed=i)
            out[i] = post(port, q)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(repr(e))

    t = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.time() - t
    if errors:
        raise RuntimeError(errors[0])
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    valid = cut = bad = 0
    if structured:
        for r in out:
            ch = r["choices"][0]
            if ch["finish_reason"] != "stop":
                cut += 1
                continue
            try:
                v = json.loads(ch["message"]["content"])
                ok = isinstance(v, dict) and set(v) == {"words"} and all(isinstance(w, str) for w in v["words"])
            except ValueError:
                ok = False
            valid += ok
            bad += not ok
    return {"mode": "json_schema" if structured else "free", "batch": b, "wall_s": round(wall, 3),
            "completion_tokens": tokens, "tok_per_s": round(tokens / wall, 1),
            "valid": valid, "cut_at_max_tokens": cut, "invalid": bad}


def main() -> int:
    argv = sys.argv[1:]
    serve_flags: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser()
    ap.add_argument("kestrel")
    ap.add_argument("model")
    ap.add_argument("port", type=int)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    cmd = [a.kestrel, "serve", a.model, "--host", "127.0.0.1", "--port", str(a.port), *serve_flags]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: [print("  |", ln.rstrip("\n"), flush=True) for ln in proc.stdout],
                     daemon=True).start()
    t0 = time.time()
    ready = False
    while time.time() - t0 < 300 and proc.poll() is None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                ready = True
                break
        except OSError:
            pass
        time.sleep(0.5)
    if not ready:
        print("server did not become ready; exit code", proc.poll())
        proc.kill()
        return 1
    rc = 0
    try:
        batch(a.port, a.model, a.batch, 8, False)  # warm-up: CUDA graphs of the batch sizes met
        batch(a.port, a.model, a.batch, 8, True)
        rates: dict = {"free": [], "json_schema": []}
        for _ in range(a.rounds):
            for structured in (False, True):
                r = batch(a.port, a.model, a.batch, a.max_tokens, structured)
                print(json.dumps(r), flush=True)
                rates[r["mode"]].append(r["tok_per_s"])
                if r["invalid"]:
                    rc = 1
        free, st = max(rates["free"]), max(rates["json_schema"])
        print(json.dumps({"summary": True, "batch": a.batch, "max_tokens": a.max_tokens,
                          "free_tok_per_s_best": free, "json_schema_tok_per_s_best": st,
                          "cost": round(1 - st / free, 4)}), flush=True)
    except Exception as e:  # noqa: BLE001
        print("error:", e)
        rc = 1
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    return rc


if __name__ == "__main__":
    sys.exit(main())
