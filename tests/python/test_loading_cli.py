"""The loading flags as vLLM has them: --load-format dummy (random weights of the checkpoint's shapes made from a
seed; only config.json is read) and --hf-overrides JSON (merged into config.json; bad JSON and unknown keys are errors
naming them), with `generate` and `serve` alike; a Kimi config.json that gives its context length as
model_max_length serves without --max-model-len."""

import json
import shutil
import subprocess

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)


def generate(model_dir, *args):
    return subprocess.run([h.kestrel_bin(), "generate", str(model_dir), "--prompt-ids", "1,2,3,4", "--max-tokens", "4",
                           *args], capture_output=True, text=True, timeout=120)


def test_dummy_weights_from_a_config_alone(tiny_dir, tmp_path):  # noqa: F811
    only = tmp_path / "config_only"
    only.mkdir()
    shutil.copy(tiny_dir / "config.json", only / "config.json")
    a = generate(only, "--load-format", "dummy")
    b = generate(only, "--load-format", "dummy")
    c = generate(only, "--load-format", "dummy", "--dummy-seed", "9")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # the same seed, the same weights, the same greedy tokens
    assert c.returncode == 0 and c.stdout != a.stdout
    # A checkpoint of those weights written by make-model loads to the same tokens as the dummy weights themselves.
    w = tmp_path / "written"
    r = subprocess.run([h.kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(w),
                        "--dummy-weights"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert generate(w).stdout == generate(w, "--load-format", "dummy").stdout


def test_hf_overrides(tiny_dir):  # noqa: F811
    r = generate(tiny_dir, "--hf-overrides", '{"num_hidden_layers": 2}')
    assert r.returncode == 0, r.stderr
    assert r.stdout != generate(tiny_dir).stdout  # fewer layers, other logits
    r = generate(tiny_dir, "--hf-overrides", '{"num_hiden_layers": 2}')
    assert r.returncode == 1 and "'num_hiden_layers'" in r.stderr
    r = generate(tiny_dir, "--hf-overrides", "{not json")
    assert r.returncode == 1 and "--hf-overrides is not valid JSON" in r.stderr
    r = generate(tiny_dir, "--hf-overrides", "[1, 2]")
    assert r.returncode == 1 and "must be a JSON object" in r.stderr
    r = generate(tiny_dir, "--load-format", "pt")
    assert r.returncode == 1 and "--load-format 'pt'" in r.stderr
    # serve takes the same flags.
    r = subprocess.run([h.kestrel_bin(), "serve", str(tiny_dir), "--hf-overrides", '{"nope": 1}'], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "'nope'" in r.stderr


def test_model_max_length_alone_serves(tiny_dir, tmp_path):  # noqa: F811
    d = tmp_path / "kimi_style"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["max_position_embeddings"]
    cfg["model_max_length"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    s = h.Server(d)
    try:
        status, body = s.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 2048
        r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        assert s.stop() == 0
    # With no context length at all, the error names the flag.
    del cfg["model_max_length"]
    (d / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([h.kestrel_bin(), "serve", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--max-model-len" in r.stderr
