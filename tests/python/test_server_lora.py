"""LoRA adapters in the server (issue 20), as vLLM serves them: `--enable-lora --lora-modules name=path`, the
/v1/load_lora_adapter and /v1/unload_lora_adapter routes, and the adapter chosen by the request's `model`.

Checked: an adapter changes the output; 8 adapters and the base model in flight at once give each request the bits
it gets alone (batch-invariant mode); /v1/models lists the adapters; loading, reloading in place and unloading
while serving; bad adapters (wrong rank, bad target module, a missing file) and bad requests are a clear 400 and
the server keeps serving; an adapter in use by a request in flight is not unloaded; teacher-forced scoring through
an adapter gives the log-probs its generation gave."""

import json
import socket
import subprocess
import threading
from pathlib import Path

import pytest

import test_server_harness as h
from kestrel_binary import kestrel_bin
from lora_files import random_adapter

PROMPT = "the adapter"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """A tiny kimi_k3 checkpoint, 9 random rank-8 adapters and one rank-16 adapter."""
    d = tmp_path_factory.mktemp("lora")
    subprocess.run([kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(d / "m"),
                    "--lora-out", str(d / "t8"), "--lora-rank", "8"], check=True, capture_output=True, timeout=120)
    subprocess.run([kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(d / "m16"),
                    "--lora-out", str(d / "t16"), "--lora-rank", "16"], check=True, capture_output=True,
                   timeout=120)
    adapters = [random_adapter(str(d / "t8"), str(d / f"a{i}"), seed=i) for i in range(9)]
    return {"model": d / "m", "adapters": adapters, "rank16": random_adapter(str(d / "t16"), str(d / "r16"), 99),
            "dir": d}


def complete(server, model, body=GREEDY):
    status, r = h.post(server.url + "/v1/completions", {**body, "model": model})
    assert status == 200, r
    c = r["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["tokens"]


def load(server, **body):
    return h.post(server.url + "/v1/load_lora_adapter", body)


def unload(server, **body):
    return h.post(server.url + "/v1/unload_lora_adapter", body)


def test_eight_adapters_in_one_batch_equal_each_alone(lora_files):
    names = [f"a{i}" for i in range(8)]
    mods = [f"{n}={p}" for n, p in zip(names, lora_files["adapters"])]
    s = h.Server(lora_files["model"], "--enable-lora", "--max-loras", "8", "--max-lora-rank", "8",
                 "--batch-invariant", "--max-num-seqs", "16", "--lora-modules", *mods)
    try:
        cards = json.loads(s.get("/v1/models")[1])["data"]
        assert [c["id"] for c in cards] == ["tiny"] + names
        assert all(c["parent"] == "tiny" for c in cards[1:]) and cards[0]["parent"] is None
        assert cards[1]["root"] == lora_files["adapters"][0]

        models = ["tiny"] + names
        alone = {m: complete(s, m) for m in models}
        base_lps = alone["tiny"][1]
        for m in names:  # every adapter changes the log-probs (the prefix cache keeps adapters apart)
            assert alone[m][1] != base_lps, m
        assert len({tuple(a[1]) for a in alone.values()}) == len(models)

        # All nine at once, twice each, in one batch: each request gets exactly the bits it got alone.
        together, errors = {}, []

        def run(m, k):
            try:
                together[(m, k)] = complete(s, m)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=run, args=(m, k)) for k in range(2) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for (m, _), out in together.items():
            assert out == alone[m], m
        s.wait_idle()
    finally:
        assert s.stop() == 0


def test_load_reload_unload_while_serving(lora_files):
    a0, a1, a2 = lora_files["adapters"][:3]
    s = h.Server(lora_files["model"], "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--batch-invariant")
    try:
        base = complete(s, "tiny")
        assert json.loads(s.get("/v1/models")[1])["data"][1:] == []
        st, r = complete_status(s, "x")
        assert st == 404 and "The model `x` does not exist." in r["error"]["message"]

        st, r = load(s, lora_name="x", lora_path=a0)
        assert st == 200 and r["status"] == "success", r
        x0 = complete(s, "x")
        assert x0 != base and complete(s, "x") == x0
        assert [c["id"] for c in json.loads(s.get("/v1/models")[1])["data"]] == ["tiny", "x"]

        st, r = load(s, lora_name="x", lora_path=a1)
        assert st == 400 and "has already been loaded" in r["error"]["message"]
        assert complete(s, "x") == x0
        st, r = load(s, lora_name="x", lora_path=a1, load_inplace=True)  # new weights under the same name
        assert st == 200, r
        x1 = complete(s, "x")
        assert x1 != x0 and x1 != base

        st, r = load(s, lora_name="y", lora_path=a2)
        assert st == 200, r
        st, r = load(s, lora_name="z", lora_path=a2)
        assert st == 400 and "--max-loras 2" in r["error"]["message"], r

        # Teacher-forced scoring through an adapter: the log-probs its generation gave, bit for bit.
        prompt = [11, 12, 13, 14, 15]
        st, out = h.post(s.url + "/v1/completions", {**GREEDY, "model": "y", "prompt": prompt, "temperature": 1.0,
                                                     "seed": 3, "return_tokens_as_token_ids": True})
        assert st == 200, out
        tokens = [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]
        lps = out["choices"][0]["logprobs"]["token_logprobs"]
        for model, equal in (("y", True), ("tiny", False), ("x", False)):
            st, r = h.post(s.url + "/v1/score_tokens", {"model": model, "prompt": prompt, "response": tokens})
            assert st == 200, r
            assert r["data"][0]["token_ids"] == tokens
            assert (r["data"][0]["logprobs"] == lps) == equal, model

        st, r = unload(s, lora_name="x")
        assert st == 200 and r["status"] == "success", r
        st, r = complete_status(s, "x")
        assert st == 404
        st, r = unload(s, lora_name="x")
        assert st == 404 and "cannot be found" in r["error"]["message"]
        # A freed slot takes a new adapter; the same name and weights again give the same output.
        st, r = load(s, lora_name="x", lora_path=a1)
        assert st == 200 and complete(s, "x") == x1
        assert complete(s, "tiny") == base
        s.wait_idle()
    finally:
        assert s.stop() == 0


def complete_status(server, model):
    return h.post(server.url + "/v1/completions", {**GREEDY, "model": model})


def test_bad_adapters_and_requests_leave_the_server_serving(lora_files, tmp_path):
    a0 = lora_files["adapters"][0]
    bad_module = random_adapter(a0, str(tmp_path / "bad_module"), 5)
    cfg = json.loads(Path(bad_module, "adapter_config.json").read_text())
    cfg["target_modules"] = ["embed_tokens"]
    Path(bad_module, "adapter_config.json").write_text(json.dumps(cfg))
    wide = random_adapter(a0, str(tmp_path / "wide"), 7, widen="lora_A")
    truncated = random_adapter(a0, str(tmp_path / "truncated"), 6)
    st_path = Path(truncated, "adapter_model.safetensors")
    st_path.write_bytes(st_path.read_bytes()[:-100])

    s = h.Server(lora_files["model"], "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    try:
        base = complete(s, "tiny")
        cases = [
            (dict(lora_name="r16", lora_path=lora_files["rank16"]), 400, "r = 16 is outside"),
            (dict(lora_name="m", lora_path=bad_module), 400, "unknown target module 'embed_tokens'"),
            (dict(lora_name="w", lora_path=wide), 400, "has input width 129, the layer takes 128"),
            (dict(lora_name="t", lora_path=truncated), 400, "cannot be loaded"),
            (dict(lora_name="n", lora_path=str(tmp_path / "nowhere")), 400, "cannot be loaded"),
            (dict(lora_name="tiny", lora_path=a0), 400, "the base model's name"),
            (dict(lora_name="a", lora_path=a0, rank=8), 400, "'rank' is not a field"),
            (dict(lora_name="a"), 400, "'lora_path' is required"),
            (dict(lora_path=a0), 400, "'lora_name' is required"),
            (dict(lora_name=3, lora_path=a0), 400, "'lora_name' must be a non-empty string"),
        ]
        for body, status, needle in cases:
            st, r = load(s, **body)
            assert st == status and needle in r["error"]["message"], (body, r)
        st, r = h.post(s.url + "/v1/load_lora_adapter", b"{not json")
        assert st == 400
        st, r = unload(s, lora_name="never")
        assert st == 404
        with pytest.raises(Exception) as e:
            s.get("/v1/load_lora_adapter")
        assert getattr(e.value, "code", None) == 405
        # None of them took a slot: two adapters still load, and the base model is untouched.
        assert load(s, lora_name="a", lora_path=a0)[0] == 200
        assert load(s, lora_name="b", lora_path=lora_files["adapters"][1])[0] == 200
        assert complete(s, "tiny") == base
        s.wait_idle()
    finally:
        assert s.stop() == 0


def test_adapter_in_use_is_not_unloaded(lora_files):
    s = h.Server(lora_files["model"], "--enable-lora", "--max-lora-rank", "8",
                 "--lora-modules", json.dumps({"name": "a", "path": lora_files["adapters"][0]}))
    try:
        max_len = json.loads(s.get("/v1/models")[1])["data"][0]["max_model_len"]
        body = json.dumps({"model": "a", "prompt": PROMPT, "max_tokens": max_len - 16, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            got = b""
            while b"data: " not in got:  # the stream has started: the request is in flight
                chunk = c.recv(4096)
                assert chunk and b" 200 OK" in got + chunk, got + chunk
                got += chunk
            # vLLM's lora_requests_info names the adapters of the running requests (the snapshot follows the
            # step that sent the first event: read until it shows, at most 200 reads).
            for _ in range(200):
                info = [ln for ln in s.get("/metrics")[1].splitlines()
                        if ln.startswith("kestrel:lora_requests_info{")]
                assert len(info) == 1 and 'max_lora="1"' in info[0] and 'waiting_lora_adapters=""' in info[0], info
                if 'running_lora_adapters="a"' in info[0]:
                    break
            assert 'running_lora_adapters="a"' in info[0], info
            st, r = unload(s, lora_name="a")
            assert st == 400 and "in use by requests in flight" in r["error"]["message"], r
            st, r = load(s, lora_name="a", lora_path=lora_files["adapters"][1], load_inplace=True)
            assert st == 400 and "in use by requests in flight" in r["error"]["message"], r
        s.wait_idle(30)  # the client left: its request is aborted
        assert 'running_lora_adapters=""' in s.get("/metrics")[1]
        st, r = unload(s, lora_name="a")
        assert st == 200, r
    finally:
        assert s.stop() == 0


def test_lora_needs_enable_lora(lora_files):
    s = h.Server(lora_files["model"])
    try:
        st, r = load(s, lora_name="a", lora_path=lora_files["adapters"][0])
        assert st == 400 and "start it with --enable-lora" in r["error"]["message"]
        assert "lora_requests_info" not in s.get("/metrics")[1]
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("args,needle", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--max-lora-rank", "65"], "--max-lora-rank 65 is outside [1, 64]"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be >= 1"),
    (["--enable-lora", "--lora-modules", "novalue"], "is not name=path"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs a name and a path"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 2}'], "'rank' is not a field"),
    (["--enable-lora", "--lora-modules", "tiny=ADAPTER"], "the base model's name"),
    (["--enable-lora", "--lora-modules", "a=ADAPTER", "b=ADAPTER"], "more than --max-loras 1"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-modules", "a=RANK16"], "r = 16 is outside"),
], ids=["needs-enable", "rank-65", "max-loras-0", "not-name-path", "json-no-path", "json-field", "base-name",
        "too-many", "rank-16"])
def test_bad_lora_flags_are_refused_by_name(lora_files, args, needle):
    args = [a.replace("ADAPTER", lora_files["adapters"][0]).replace("RANK16", lora_files["rank16"]) for a in args]
    p = subprocess.run([kestrel_bin(), "serve", str(lora_files["model"]), "--port", "0", "--served-model-name",
                        "tiny", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert needle in p.stderr, p.stderr
