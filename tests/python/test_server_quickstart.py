"""The seed's NVIDIA quick-start command on the tiny kimi_k3 models with a DSpark drafter made by `make-model
--dspark-out`:

  kestrel serve MODEL --tensor-parallel-size 8 --trust-remote-code --load-format fastsafetensors
    --enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3
    --speculative-config '{"model": DRAFTER, "num_speculative_tokens": 5, "method": "dspark",
                           "draft_sample_method": "probabilistic"}'

Every flag but --tensor-parallel-size is served here (on the CPU); the command with it is tried as written and the
test of that part is skipped, with the server's reason, while tensor parallelism is refused on this build."""

import json
import subprocess

import numpy as np
import pytest

import test_server_harness as h
from test_server_harness import scripted_dir  # noqa: F401 (fixture)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def spec_config(drafter):
    return json.dumps({"model": str(drafter), "num_speculative_tokens": 5, "method": "dspark",
                       "draft_sample_method": "probabilistic"})


def quickstart_args(drafter, tp=True):
    return [*(["--tensor-parallel-size", "8"] if tp else []), "--trust-remote-code", "--load-format",
            "fastsafetensors", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser",
            "kimi_k3", "--speculative-config", spec_config(drafter)]


def make_drafter(model_dir, out):
    """make-model's DSpark drafter for an existing checkpoint: written for the tiny preset, then given the
    checkpoint's embedding and head (and Markov rows for the tokens the scripted model added), as vLLM shares them."""
    tmp = out.parent / (out.name + "_preset")
    subprocess.run([h.kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(tmp),
                    "--dspark-out", str(out)], check=True, capture_output=True, timeout=120)
    target, _ = h._read_safetensors(model_dir / "model.safetensors")
    tensors, meta = h._read_safetensors(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    vocab = target["model.embed_tokens.weight"][1][0]
    tensors["embed.weight"] = target["model.embed_tokens.weight"]
    tensors["head.weight"] = target["lm_head.weight"]
    for name in ("mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight"):
        dtype, shape, raw = tensors[name]
        m = np.zeros((vocab, shape[1]), dtype=np.float32)
        m[:shape[0]] = h._bf16_to_f32(raw, shape)
        tensors[name] = ("BF16", [vocab, shape[1]], h._f32_to_bf16(m))
    config["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h._write_safetensors(out / "model.safetensors", tensors, meta)
    return out


@pytest.fixture(scope="module")
def drafter(scripted_dir, tmp_path_factory):  # noqa: F811
    return make_drafter(scripted_dir, tmp_path_factory.mktemp("dspark") / "drafter")


@pytest.fixture(scope="module")
def quickstart(scripted_dir, drafter):  # noqa: F811
    s = h.Server(scripted_dir, *quickstart_args(drafter, tp=False), name="scripted")
    yield s
    assert s.stop() == 0


def test_quickstart_serves_tool_calls_and_reasoning_through_dspark(quickstart):
    r = quickstart.client().chat.completions.create(model="scripted", messages=USER, tools=TOOLS)
    m = r.choices[0].message
    assert m.reasoning_content == h.REASONING
    assert m.content == h.CONTENT
    assert [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        (h.CALL_ID, "get_weather", {"city": "Paris"})]
    assert r.choices[0].finish_reason == "tool_calls"
    c = quickstart.client().completions.create(model="scripted", prompt="Z", max_tokens=20)
    assert c.choices[0].text == h.SCRIPTED_COMPLETION
    metrics = quickstart.wait_idle()
    assert metrics["kestrel:spec_decode_num_drafts_total"] > 0
    assert metrics["kestrel:spec_decode_num_draft_tokens_total"] > metrics["kestrel:spec_decode_num_drafts_total"]


def test_quickstart_sampled_requests_repeat_with_a_seed(quickstart):
    kw = dict(model="scripted", prompt="Z", max_tokens=12, temperature=1.0, top_p=0.95, seed=5)
    a = quickstart.client().completions.create(**kw).choices[0].text
    assert a == quickstart.client().completions.create(**kw).choices[0].text


def test_quickstart_with_tensor_parallel_size_8(scripted_dir, drafter):  # noqa: F811
    try:
        s = h.Server(scripted_dir, *quickstart_args(drafter), name="scripted")
    except pytest.fail.Exception as e:
        refused = [line.strip() for line in str(e).splitlines() if "--tensor-parallel-size 8" in line]
        if refused:
            pytest.skip("the command as written needs tensor parallelism, refused on this build: " + refused[0])
        raise
    try:
        r = s.client().chat.completions.create(model="scripted", messages=USER, tools=TOOLS)
        assert r.choices[0].message.reasoning_content == h.REASONING
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        assert s.stop() == 0


def test_a_drafter_of_another_vocabulary_is_an_error_naming_the_field(scripted_dir, tmp_path):  # noqa: F811
    out = tmp_path / "drafter"
    subprocess.run([h.kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out",
                    str(tmp_path / "m"), "--dspark-out", str(out)], check=True, capture_output=True, timeout=120)
    r = subprocess.run([h.kestrel_bin(), "serve", str(scripted_dir), "--port", "0", *quickstart_args(out, tp=False)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "the DSpark drafter's 'vocab_size' 4096 does not match the target's vocabulary" in r.stderr, r.stderr


@pytest.mark.parametrize("cfg, words", [
    ("{not json", "--speculative-config is not valid JSON"),
    ('{"method": "eagle3", "num_speculative_tokens": 5}', "'method' 'eagle3' is not one of ngram, mtp, dspark"),
    ('{"method": "dspark", "num_speculative_tokens": 5, "draft_sample": "probabilistic"}',
     "unknown field 'draft_sample'"),
])
def test_bad_speculative_configs_are_errors_naming_the_field(scripted_dir, cfg, words):  # noqa: F811
    r = subprocess.run([h.kestrel_bin(), "serve", str(scripted_dir), "--port", "0", "--speculative-config", cfg],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert words in r.stderr, r.stderr


def test_mtp_through_the_server_equals_without_speculation(tmp_path):
    """DeepSeek-V3.2's own MTP layer (make-model writes it for deepseek_v32) through `kestrel serve`: greedy text and
    log-probabilities as without speculation, drafts counted."""
    d = tmp_path / "ds"
    subprocess.run([h.kestrel_bin(), "make-model", "--arch", "deepseek_v32", "--preset", "tiny", "--out", str(d)],
                   check=True, capture_output=True, timeout=120)
    plain = h.Server(d)
    spec = h.Server(d, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
    try:
        for prompt in ([5, 6, 7, 8, 9], list(range(30, 60))):
            kw = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                      extra_body={"ignore_eos": True})
            a = plain.client().completions.create(**kw).choices[0]
            b = spec.client().completions.create(**kw).choices[0]
            assert (b.text, b.logprobs.token_logprobs) == (a.text, a.logprobs.token_logprobs)
        m = spec.wait_idle()
        assert m["kestrel:spec_decode_num_drafts_total"] > 0
    finally:
        assert plain.stop() == 0
        assert spec.stop() == 0
