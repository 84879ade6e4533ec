"""`kestrel serve --speculative-config` (n-gram) on the tiny model: greedy completions and their log-probabilities are
those of a server without speculation, /metrics carries vLLM's spec_decode counters, and `kestrel bench serve`
reports the acceptance length from them."""

import json
import subprocess

import pytest

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# Token ids with repeats, so that prompt lookup has something to propose.
PROMPTS = [[5, 6, 7, 8] * 4, [9, 3, 9, 3, 9, 3, 11], list(range(20, 40))]


@pytest.fixture(scope="module")
def servers(tiny_dir):  # noqa: F811
    plain = h.Server(tiny_dir)
    spec = h.Server(tiny_dir, "--speculative-config", NGRAM)
    yield plain, spec
    assert plain.stop() == 0
    assert spec.stop() == 0


def complete(server, prompt):
    # repetition_penalty < 1 makes the random tiny model repeat itself: the drafts get accepted sometimes.
    r = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=1,
                                           extra_body={"ignore_eos": True, "repetition_penalty": 0.05})
    c = r.choices[0]
    return c.text, c.logprobs.token_logprobs


def streamed(server, prompt):
    chunks = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True,
                                                extra_body={"ignore_eos": True, "repetition_penalty": 0.05})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_greedy_outputs_and_logprobs_equal_without_speculation(servers):
    plain, spec = servers
    for p in PROMPTS:
        text, logprobs = complete(spec, p)
        assert (text, logprobs) == complete(plain, p)
        assert streamed(spec, p) == text  # several tokens of one step stream in order
    m = spec.wait_idle()
    drafts = m["kestrel:spec_decode_num_drafts_total"]
    accepted = m["kestrel:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= m["kestrel:spec_decode_num_draft_tokens_total"]
    per_pos = [m[("kestrel:spec_decode_num_accepted_tokens_per_pos_total", ("position", str(i)))] for i in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert "kestrel:spec_decode_num_drafts_total" not in plain.metrics()


def test_bench_serve_reports_the_acceptance_length(servers, tmp_path):
    _, spec = servers
    out = tmp_path / "result.json"
    r = subprocess.run([h.kestrel_bin(), "bench", "serve", "--base-url", spec.url, "--save-result", str(out),
                        "--dataset", "random", "--num-prompts", "4", "--max-concurrency", "2", "--random-input-len", "256",
                        "--random-output-len", "24", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["spec_decode_num_drafts"] > 0
    assert res["spec_decode_acceptance_length"] == pytest.approx(
        1 + res["spec_decode_accepted_tokens"] / res["spec_decode_num_drafts"])
    assert "Acceptance length:" in r.stdout
