"""Issue 21: the vLLM surface a user reaches for first. Each new flag is tried against `kestrel serve` (accepted and
acting, or refused by name with the reason), plus `kestrel --version`, `/ping`, CORS, the new metrics, and echo with
logprobs."""

import json
import shutil
import socket
import subprocess

import pytest

import test_server_harness as h
from kestrel_binary import kestrel_bin
from test_server_harness import tiny_dir  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def gen_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    return d


@pytest.fixture(scope="module")
def server(gen_dir):
    s = h.Server(f"--model={gen_dir}", "--served-model-name", "tiny", "alias-a", "alias-b", "--max-model-len", "1k",
                 "--dtype", "bfloat16", "--enforce-eager", "--disable-log-requests", "--uvicorn-log-level", "warning",
                 "--max-logprobs", 5, "--allowed-origins", '["https://ok.example"]', "--generation-config", "auto",
                 name=None)
    yield s
    assert s.stop() == 0


def test_version():
    p = subprocess.run([kestrel_bin(), "--version"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    assert p.stdout.strip() == "kestrel 0.1.0"


def test_model_flag_names_and_max_model_len_suffix(server):
    models = json.loads(server.get("/v1/models")[1])["data"]
    assert [m["id"] for m in models] == ["tiny", "alias-a", "alias-b"]
    assert {m["max_model_len"] for m in models} == {1000}  # 1k = 1000 (1K would be 1024)
    for name in ["tiny", "alias-b"]:
        status, r = h.post(server.url + "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2,
                                                           "ignore_eos": True})
        assert status == 200 and r["model"] == "tiny"
    status, r = h.post(server.url + "/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 2})
    assert status == 404


def test_generation_config_defaults(server):
    # max_new_tokens 5 of generation_config.json is the default max_tokens; a request's own value wins.
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "ignore_eos": True})
    assert status == 200 and r["usage"]["completion_tokens"] == 5
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "ignore_eos": True,
                                                       "max_tokens": 2})
    assert r["usage"]["completion_tokens"] == 2


def test_max_logprobs(server):
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                       "logprobs": 6})
    assert status == 400 and r["error"]["param"] == "logprobs"
    assert "--max-logprobs" in r["error"]["message"]
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                       "logprobs": 5})
    assert status == 200


def raw(port, request: bytes):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(request)
        out = b""
        while True:
            part = c.recv(65536)
            if not part:
                break
            out += part
    return out.decode(errors="replace")


def test_cors(server):
    pre = raw(server.port, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Origin: https://ok.example\r\nAccess-Control-Request-Method: POST\r\n"
                           b"Access-Control-Request-Headers: content-type, authorization\r\n\r\n").lower()
    assert pre.startswith("http/1.1 200")
    assert "access-control-allow-origin: https://ok.example" in pre
    assert "access-control-allow-methods:" in pre and "post" in pre
    assert "access-control-allow-headers: content-type, authorization" in pre
    get = raw(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Origin: https://ok.example\r\n\r\n").lower()
    assert "access-control-allow-origin: https://ok.example" in get
    other = raw(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                             b"Origin: https://evil.example\r\n\r\n").lower()
    assert "access-control-allow-origin" not in other


def test_ping(server):
    assert server.get("/ping")[0] == 200
    status, _ = h.post(server.url + "/ping", b"")
    assert status == 200


def test_new_metrics(server):
    h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    m = server.wait_idle()
    assert m["kestrel:request_prompt_tokens_count"] >= 1
    assert m["kestrel:request_generation_tokens_sum"] >= 4
    assert m["kestrel:time_per_output_token_seconds_count"] >= 1
    assert m["kestrel:iteration_tokens_total_count"] >= 4  # a prefill step and three decode steps at least
    info = [k for k in m if isinstance(k, tuple) and k[0] == "kestrel:cache_config_info"]
    assert len(info) == 1 and m[info[0]] == 1
    labels = dict(info[0][1:])
    assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0
    assert labels["enable_prefix_caching"] == "True"


def test_echo_with_logprobs_has_prompt_tokens_and_offsets_into_text(server):
    status, r = h.post(server.url + "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 3,
                                                       "ignore_eos": True, "echo": True, "logprobs": 2})
    assert status == 200
    c = r["choices"][0]
    lp = c["logprobs"]
    text = c["text"]
    assert text.startswith("hello world")
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    # Each offset indexes its token's text in `text`.
    assert "".join(lp["tokens"][:n_prompt]) == "hello world"
    for off, tok in zip(lp["text_offset"], lp["tokens"]):
        assert text[off:off + len(tok)] == tok
    assert lp["text_offset"][n_prompt] == len("hello world")


@pytest.mark.parametrize("flag,needle", [
    (["--data-parallel-size", "2"], "--data-parallel-size 2: data parallelism"),
    (["--enable-expert-parallel"], "--enable-expert-parallel: expert parallelism needs NCCL"),
    (["--dtype", "float16"], "--dtype float16: weights are kept in their stored precision"),
    (["--max-model-len", "12q"], "--max-model-len '12q' is not an integer"),
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level 'loud'"),
], ids=["dp", "ep", "dtype", "max-model-len", "log-level"])
def test_refused_by_name(tiny_dir, flag, needle):  # noqa: F811
    p = subprocess.run([kestrel_bin(), "serve", str(tiny_dir), "--port", "0", *flag], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
    assert needle in p.stderr


def test_max_model_len_binary_suffix(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--max-model-len", "1K")
    try:
        assert json.loads(s.get("/v1/models")[1])["data"][0]["max_model_len"] == 1024
    finally:
        assert s.stop() == 0


def test_score_tokens_takes_every_name(server):
    for name in ["tiny", "alias-a"]:
        status, r = h.post(server.url + "/v1/score_tokens", {"model": name, "prompt": "hello world"})
        assert status == 200, r
        assert len(r["data"][0]["logprobs"]) == len(r["data"][0]["token_ids"]) >= 1
    status, r = h.post(server.url + "/v1/score_tokens", {"model": "other", "prompt": "hello world"})
    assert status == 404
