"""`kestrel bench serve` against `kestrel serve` on the tiny model: the vLLM metric set, token totals that match
what was asked, the agentic dataset's prefix-hit rate agreeing with the server's counters, and a concurrency sweep
whose frontier plots to a PNG."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

VLLM_KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", "max_output_tokens_per_s"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")]


@pytest.fixture(scope="module")
def server(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir)
    yield s
    assert s.stop() == 0


def bench(server, tmp_path, *args):
    out = tmp_path / "result.json"
    r = subprocess.run([h.kestrel_bin(), "bench", "serve", "--base-url", server.url, "--save-result", str(out),
                        *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r.stdout


def test_random_dataset_reports_the_vllm_metrics(server, tmp_path):
    res, text = bench(server, tmp_path, "--dataset", "random", "--num-prompts", 12, "--max-concurrency", 4,
                      "--random-input-len", 48, "--random-output-len", 10, "--ignore-eos", "--goodput", "ttft:60000")
    for k in VLLM_KEYS + ["request_goodput"]:
        assert k in res, k
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["total_input_tokens"] == 12 * 48 and res["total_output_tokens"] == 12 * 10
    assert res["output_throughput"] == pytest.approx(120 / res["duration"])
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # a 60 s TTFT bound holds for all
    assert res["mean_ttft_ms"] > 0 and res["p99_e2el_ms"] >= res["median_e2el_ms"] >= res["median_ttft_ms"]
    assert res["median_ttft_ms"] <= res["p99_ttft_ms"]
    for line in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 ITL (ms):"):
        assert line in text


def test_agentic_dataset_reports_its_prefix_hit_rate(server, tmp_path):
    turns, prefix, turn, out = 3, 256, 64, 8
    res, text = bench(server, tmp_path, "--dataset", "agentic", "--num-prompts", 6, "--max-concurrency", 2,
                      "--agentic-turns", turns, "--agentic-prefix-len", prefix, "--agentic-turn-len", turn,
                      "--agentic-salt-len", 8, "--agentic-think-time", 0.01, "--random-output-len", out,
                      "--ignore-eos")
    assert res["completed"] == 6 and res["failed"] == 0
    # Two sessions; turn k's prompt is salt + prefix + k user messages + (k - 1) answers.
    per_session = sum(8 + prefix + (k + 1) * turn + k * out for k in range(turns))
    assert res["total_input_tokens"] == 2 * per_session
    assert 0.3 < res["prefix_hit_rate"] < 1
    assert res["server_prefix_hit_rate"] == pytest.approx(res["prefix_hit_rate"])
    assert "Prefix cache hit rate (usage):" in text


def test_concurrency_sweep_plots_a_frontier(server, tmp_path):
    res, text = bench(server, tmp_path, "--num-prompts", 6, "--random-input-len", 32, "--random-output-len", 8,
                      "--ignore-eos", "--sweep-concurrency", "1,3")
    assert [r["max_concurrency"] for r in res["sweep"]] == [1, 3]
    for r in res["sweep"]:
        assert r["completed"] == 6
        assert r["output_tokens_per_s_per_user"] == pytest.approx(1000 / r["mean_tpot_ms"])
    assert "frontier" in text
    png = tmp_path / "frontier.png"
    script = Path(__file__).resolve().parents[2] / "bench" / "serve" / "plot_frontier.py"
    subprocess.run([sys.executable, str(script), str(tmp_path / "result.json"), "--out", str(png)], check=True,
                   capture_output=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
