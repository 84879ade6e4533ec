"""Scoring and the RL control routes of `kestrel serve` (--batch-invariant) on the tiny kimi_k3 model:
prompt_logprobs in completions and chat (vLLM's format), /v1/score_tokens equal to the log-probabilities the same
tokens got when they were sampled, /pause (abort, wait, keep) with /resume and /is_paused, and their errors."""

import threading
import time
import urllib.error

import pytest

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--batch-invariant", "--max-num-batched-tokens", "32")
    yield s
    assert s.stop() == 0


def completion(server, **body):
    status, out = h.post(server.url + "/v1/completions", {"model": "tiny", **body})
    assert status == 200, out
    return out


def test_prompt_logprobs_in_completions(server):
    ids = [5, 17, 99, 3, 250, 7, 42]
    out = completion(server, prompt=ids, max_tokens=1, prompt_logprobs=2, temperature=0)
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos, entry in enumerate(plp[1:], start=1):
        token = entry[str(ids[pos])]  # the prompt token itself, then its 2 best alternatives
        alternatives = {k: v for k, v in entry.items() if k != str(ids[pos])}
        assert len(alternatives) == (1 if token["rank"] <= 2 else 2)
        assert all(v["rank"] in (1, 2) for v in alternatives.values())
        best = min(entry.values(), key=lambda v: v["rank"])
        assert best["logprob"] >= token["logprob"] and all(v["logprob"] <= 0 for v in entry.values())
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_prompt_logprobs_in_chat_and_refused_when_streaming(server):
    status, out = h.post(server.url + "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200, out
    plp = out["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])
    assert "prompt_logprobs" not in out["choices"][0]
    status, err = h.post(server.url + "/v1/completions",
                         {"prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"


def test_score_tokens_equals_the_sampled_logprobs(server):
    """The RL loop over HTTP: sample with log-probabilities, then score prompt + completion by teacher forcing; every
    token's score is the float it was sampled with."""
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,
                36, 37, 38, 39, 40], [200, 201], [60, 61, 62, 63, 64, 65, 66]]
    out = completion(server, prompt=prompts, max_tokens=12, n=2, temperature=1.0, seed=7, logprobs=0,
                     ignore_eos=True, return_tokens_as_token_ids=True)
    rollouts = []
    for c in out["choices"]:
        tokens = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
        rollouts.append((prompts[c["index"] // 2], tokens, c["logprobs"]["token_logprobs"]))
    status, scored = h.post(server.url + "/v1/score_tokens", {
        "model": "tiny", "prompt": [p for p, _, _ in rollouts], "response": [t for _, t, _ in rollouts],
        "top_logprobs": 1})
    assert status == 200, scored
    assert scored["object"] == "score_tokens"
    assert len(scored["data"]) == len(rollouts)
    for (prompt, tokens, logprobs), item in zip(rollouts, scored["data"]):
        assert item["start"] == len(prompt)
        assert item["token_ids"] == tokens
        assert item["logprobs"] == logprobs  # exactly: KL 0.0
        assert len(item["top_logprobs"]) == len(tokens)
    assert scored["usage"]["prompt_tokens"] == sum(len(p) + len(t) for p, t, _ in rollouts)

    # Without responses, every token from `start` on; the prompt-log-probs of a completion are the same numbers.
    seq = prompts[0] + rollouts[0][1]
    status, whole = h.post(server.url + "/v1/score_tokens", {"prompt": seq, "start": 1})
    assert status == 200, whole
    plp = completion(server, prompt=seq, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert whole["data"][0]["logprobs"] == [plp[i][str(seq[i])]["logprob"] for i in range(1, len(seq))]
    assert whole["data"][0]["logprobs"][len(prompts[0]) - 1:] == rollouts[0][2]
    assert whole["data"][0]["top_logprobs"] is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2, 3], "start": 3}, "start"),
    ({"prompt": [1], "start": 1}, "start"),
    ({"prompt": [1, 2], "response": []}, "response"),
    ({"prompt": [1, 2], "logprobs": 1}, "logprobs"),
    ({"prompt": [1, 2**30]}, "prompt"),
])
def test_score_tokens_errors(server, body, param):
    status, err = h.post(server.url + "/v1/score_tokens", body)
    assert status == 400, err
    assert err["error"]["param"] == param


def test_score_tokens_unknown_model(server):
    status, err = h.post(server.url + "/v1/score_tokens", {"model": "other", "prompt": [1, 2]})
    assert status == 404


def _in_thread(fn):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    t.start()
    return t, result


def _wait_running(server, job):
    deadline = time.time() + 30
    while server.metrics()["kestrel:num_requests_running"] == 0:
        assert job.is_alive(), "the request ended before it was seen running"
        assert time.time() < deadline, "the request never started"
        time.sleep(0.01)


def test_pause_abort_then_resume(server):
    # No max_tokens: it runs to max_model_len unless the pause ends it.
    long_job, result = _in_thread(lambda: completion(server, prompt=[1, 2, 3], ignore_eos=True))
    _wait_running(server, long_job)
    status, out = h.post(server.url + "/pause", b"")
    assert (status, out) == (200, {"status": "paused"})
    assert server.get("/is_paused") == (200, '{"is_paused":true}')
    long_job.join(30)
    assert result["value"]["choices"][0]["finish_reason"] == "abort"
    # A request made while paused waits, and runs after /resume.
    queued, got = _in_thread(lambda: completion(server, prompt=[4, 5], max_tokens=2))
    time.sleep(0.2)
    assert queued.is_alive()
    assert h.post(server.url + "/resume", b"") == (200, {"status": "resumed"})
    queued.join(30)
    assert got["value"]["usage"]["completion_tokens"] == 2
    assert server.get("/is_paused") == (200, '{"is_paused":false}')


def test_pause_wait_and_keep(server):
    job, result = _in_thread(lambda: completion(server, prompt=[9, 9], max_tokens=1500, ignore_eos=True,
                                                temperature=0))
    _wait_running(server, job)
    try:
        assert h.post(server.url + "/pause?mode=wait&clear_cache=false", b"") == (200, {"status": "paused"})
        assert server.metrics()["kestrel:num_requests_running"] == 0  # the engine finished it first
        job.join(30)
        assert result["value"]["choices"][0]["finish_reason"] == "length"
        assert result["value"]["usage"]["completion_tokens"] == 1500
    finally:
        assert h.post(server.url + "/resume", b"")[0] == 200

    # Long enough that the pause comes before the end; frozen longer than the whole request takes.
    start = time.time()
    reference = completion(server, prompt=[8, 8, 8], max_tokens=1500, ignore_eos=True, temperature=0)
    duration = time.time() - start
    job, result = _in_thread(lambda: completion(server, prompt=[8, 8, 8], max_tokens=1500, ignore_eos=True,
                                                temperature=0))
    _wait_running(server, job)
    try:
        assert h.post(server.url + "/pause?mode=keep", b"") == (200, {"status": "paused"})
        time.sleep(duration + 0.2)
        assert job.is_alive()  # frozen, not ended
    finally:
        assert h.post(server.url + "/resume", b"")[0] == 200
    job.join(60)
    assert result["value"]["choices"][0]["text"] == reference["choices"][0]["text"]


def test_pause_errors(server):
    status, err = h.post(server.url + "/pause?mode=later", b"")
    assert status == 400 and err["error"]["param"] == "mode"
    status, err = h.post(server.url + "/pause?clear_cache=maybe", b"")
    assert status == 400 and err["error"]["param"] == "clear_cache"
    with pytest.raises(urllib.error.HTTPError) as e:
        server.get("/pause")
    assert e.value.code == 405
    assert server.get("/is_paused") == (200, '{"is_paused":false}')
