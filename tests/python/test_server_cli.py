"""`kestrel serve` takes vLLM's flags: the seed's quick-start commands are understood (every flag known); what needs
hardware or features this build lacks is refused with a message naming it; the same command without those flags
starts a server that answers a chat request; unknown flags are errors."""

import subprocess

import test_server_harness as h
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

SPEC = ('{"model":"Inferact/Kimi-K3.1-Pro-DSpark-preview","num_speculative_tokens":5,"method":"dspark",'
        '"draft_sample_method":"probabilistic"}')
NVIDIA = ["--tensor-parallel-size", "8", "--trust-remote-code", "--load-format", "fastsafetensors",
          "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3",
          "--speculative-config", SPEC]
AMD = ["--served-model-name", "kimi-k31-pro", "--tensor-parallel-size", "8", "--trust-remote-code", "--load-format",
       "fastsafetensors", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.85", "--speculative-config", SPEC]


def run(model_dir, args):
    return subprocess.run([h.kestrel_bin(), "serve", str(model_dir), *args], capture_output=True, text=True,
                          timeout=60)


def test_quick_start_commands_are_understood_and_refused_on_the_cpu(tiny_dir):  # noqa: F811
    for args in (NVIDIA, AMD):
        r = run(tiny_dir, args)
        assert r.returncode == 1
        assert "--tensor-parallel-size 8" in r.stderr and "needs 8 GPUs" in r.stderr
        # The DSpark drafter is built (test_server_quickstart.py serves the command with a make-model drafter).
        assert "not built" not in r.stderr
        assert "not expected" not in r.stderr  # CLI11's wording for unknown arguments


def test_quick_start_without_unbuilt_features_serves_chat(tiny_dir):  # noqa: F811
    args = [a for a in NVIDIA]
    i = args.index("--speculative-config")
    del args[i:i + 2]
    args[args.index("--tensor-parallel-size") + 1] = "1"
    s = h.Server(tiny_dir, *args)
    try:
        r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert any("fastsafetensors" in line for line in s.log)
    finally:
        assert s.stop() == 0


def test_unknown_flags_and_values_are_errors(tiny_dir):  # noqa: F811
    r = run(tiny_dir, ["--frobnicate", "1"])
    assert r.returncode != 0 and "--frobnicate" in r.stderr
    r = run(tiny_dir, ["--tool-call-parser", "hermes"])
    assert r.returncode == 1 and "hermes" in r.stderr
    r = run(tiny_dir, ["--kv-cache-dtype", "int3"])
    assert r.returncode == 1 and "int3" in r.stderr
    r = run(tiny_dir, ["--enable-auto-tool-choice"])
    assert r.returncode == 1 and "--tool-call-parser" in r.stderr


def test_device_cuda_without_a_gpu_is_refused(tiny_dir):  # noqa: F811
    # CI has no GPU: --device cuda must say why it cannot run (no device, or a build without CUDA), not fall back.
    r = run(tiny_dir, ["--device", "cuda"])
    assert r.returncode == 1
    assert "--device cuda" in r.stderr
    assert "no CUDA device is visible" in r.stderr or "without the CUDA backend" in r.stderr
    r = run(tiny_dir, ["--device", "tpu"])
    assert r.returncode == 1 and "tpu" in r.stderr
