"""The `kestrel` Python module (python/): LLM.generate with vLLM's SamplingParams and outputs, prompt_logprobs, stop
strings, refusals by name, and the zero-mismatch RL loop: 100 rollout-then-score steps on a tiny model of each
architecture in batch-invariant mode, with random batches, step budgets (chunk sizes) and prefix hits; every scored
log-probability equals its rollout log-probability bit for bit (KL exactly 0.0), printed per step."""

import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_binary import REPO, kestrel_bin
from lora_files import random_adapter


def _module_dir() -> Path:
    """$KESTREL_PYTHONPATH, else <build>/python beside the kestrel binary; skip for a checkout with no build, fail
    when the binary exists (the build has the module whenever pybind11 is installed, which setup.sh does)."""
    if os.environ.get("KESTREL_PYTHONPATH"):
        return Path(os.environ["KESTREL_PYTHONPATH"])
    binary = Path(kestrel_bin())
    return binary.parent.parent / "python"


@pytest.fixture(scope="module")
def kestrel():
    # The engine in this process shares two cores with other test processes (CI): OpenMP threads waiting at barriers
    # for time slices make a tiny model's step many times slower, and results do not depend on the thread count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = _module_dir()
    if not (path / "kestrel" / "__init__.py").exists():
        pytest.fail(f"no kestrel Python module under {path}: build with pybind11-dev installed "
                    "(or set KESTREL_PYTHONPATH)")
    sys.path.insert(0, str(path))
    import kestrel as k
    return k


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ("kimi_k3", "kimi_linear", "deepseek_v32"):
        d = tmp_path_factory.mktemp(arch)
        subprocess.run([kestrel_bin(), "make-model", "--arch", arch, "--preset", "tiny", "--out", str(d),
                        "--dspark-out", str(d) + "_dspark"], check=True, capture_output=True, timeout=120)
        out[arch] = str(d)
    return out


def bits(x: float) -> bytes:
    return struct.pack("<f", x)


def test_generate_with_vllm_names(kestrel, models):
    llm = kestrel.LLM(models["kimi_k3"], max_model_len=256)
    p = kestrel.SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate(["Hello world", {"prompt_token_ids": [5, 6, 7, 8]}], p)
    assert [o.prompt for o in outs] == ["Hello world", None]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 6 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == 6
        for tok, lp in zip(c.token_ids, c.logprobs):
            first = next(iter(lp))
            assert first == tok  # the sampled token first, then the 2 best (greedy: it is one of them)
            assert lp[tok].rank == 1 and len(lp) == 2
        assert math.isclose(c.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
        for tok, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
            assert tok in lp and lp[tok].decoded_token is not None
    # Greedy is reproducible, and the same alone as in a batch.
    again = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, p)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert [bits(lp[t].logprob) for t, lp in zip(again.outputs[0].token_ids, again.outputs[0].logprobs)] == \
        [bits(lp[t].logprob) for t, lp in zip(outs[1].outputs[0].token_ids, outs[1].outputs[0].logprobs)]


def test_sampling_seeds_n_and_stop_strings(kestrel, models):
    llm = kestrel.LLM(models["kimi_linear"], max_model_len=128, seed=3)
    p = kestrel.SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, p)[0]
    b = llm.generate({"prompt_token_ids": [1, 2, 3]}, p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # A stop string cut out of the text of the first completion ends it there.
    first = a.outputs[0]
    full = llm.get_tokenizer().decode(first.token_ids, skip_special_tokens=True)
    if len(full) >= 3:
        stop = full[1:3]
        s = kestrel.SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, stop=stop)
        c = llm.generate({"prompt_token_ids": [1, 2, 3]}, s)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == full[:full.index(stop)]
        assert c.token_ids == first.token_ids[:len(c.token_ids)]


def test_score_by_teacher_forcing(kestrel, models):
    llm = kestrel.LLM(models["deepseek_v32"], max_model_len=128, batch_invariant=True)
    rollout = llm.generate({"prompt_token_ids": [9, 8, 7, 6]},
                           kestrel.SamplingParams(temperature=1.0, seed=5, max_tokens=10, logprobs=0,
                                                  ignore_eos=True))[0].outputs[0]
    scored = llm.score([[9, 8, 7, 6]], [rollout.token_ids], top_logprobs=2)[0]
    assert scored.start == 4 and scored.token_ids == rollout.token_ids
    assert [bits(x) for x in scored.logprobs] == [bits(lp[t].logprob)
                                                  for t, lp in zip(rollout.token_ids, rollout.logprobs)]
    assert len(scored.top_logprobs) == 10 and all(t in d for t, d in zip(scored.token_ids, scored.top_logprobs))
    whole = llm.score({"prompt_token_ids": [9, 8, 7, 6] + rollout.token_ids})[0]
    assert whole.start == 1 and [bits(x) for x in whole.logprobs[3:]] == [bits(x) for x in scored.logprobs]
    assert whole.top_logprobs is None


def test_refusals_name_what_is_missing(kestrel, models):
    with pytest.raises(TypeError, match="frobnicate"):
        kestrel.LLM(models["kimi_k3"], frobnicate=1)
    with pytest.raises(NotImplementedError, match="tensor_parallel_size"):
        kestrel.LLM(models["kimi_k3"], tensor_parallel_size=2)
    with pytest.raises(NotImplementedError, match="logit_bias"):
        kestrel.SamplingParams(logit_bias={1: 2.0})
    with pytest.raises(ValueError, match="top_p"):
        kestrel.SamplingParams(top_p=0)
    llm = kestrel.LLM(models["kimi_k3"], max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("x", lora_request=kestrel.LoRARequest("a", 1, "/nonexistent"))
    with pytest.raises(NotImplementedError, match="sleep"):
        llm.sleep()
    with pytest.raises(ValueError, match="max_model_len 64"):
        llm.generate({"prompt_token_ids": [1] * 60}, kestrel.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="greater than max allowed"):
        llm.generate("x", kestrel.SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="nothing to score|no token to score"):
        llm.score([[1, 2]], [[]])
    # The engine is left clean: the next request runs.
    assert len(llm.generate("x", kestrel.SamplingParams(max_tokens=2))[0].outputs[0].token_ids) >= 1
    assert llm.reset_prefix_cache()


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear", "deepseek_v32"])
def test_rl_loop_scoring_equals_rollout_bit_for_bit(kestrel, models, arch, capsys):
    rng = random.Random(7)
    # Three engines of different step budgets: prompts are cut into chunks of different sizes.
    llms = [kestrel.LLM(models[arch], max_model_len=128, max_num_batched_tokens=b, batch_invariant=True,
                        seed=b) for b in (7, 32, 256)]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 32))] for _ in range(6)]
    total = 0
    previous = []
    for step in range(100):
        rollout_llm, score_llm = rng.choice(llms), rng.choice(llms)
        chosen = [rng.choice(prompts) for _ in range(rng.randint(1, 3))]
        params = [kestrel.SamplingParams(n=rng.randint(1, 2), temperature=1.0, top_k=rng.choice([0, 20]),
                                         max_tokens=rng.randint(1, 8), seed=rng.getrandbits(32), logprobs=0,
                                         ignore_eos=True) for _ in chosen]
        outs = rollout_llm.generate([{"prompt_token_ids": p} for p in chosen], params)
        rollouts = [(o.prompt_token_ids, c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                    for o in outs for c in o.outputs]
        # Score this step's rollouts together with the previous step's (a different batch composition).
        batch = rollouts + previous
        rng.shuffle(batch)
        scores = score_llm.score([p for p, _, _ in batch], [t for _, t, _ in batch])
        diffs = [(a - b) for (_, _, want), s in zip(batch, scores) for a, b in zip(want, s.logprobs)]
        for (_, tokens, want), s in zip(batch, scores):
            assert s.token_ids == tokens
            assert [bits(x) for x in s.logprobs] == [bits(x) for x in want], f"{arch} step {step}"
        kl = sum(diffs) / len(diffs)
        assert kl == 0.0
        with capsys.disabled():
            print(f"\n[rl-loop python] {arch} step {step:3d}: {len(batch)} sequences, {len(diffs)} tokens, "
                  f"KL {kl:.1f}, max |diff| {max(abs(d) for d in diffs):.1f}", end="")
        total += len(diffs)
        previous = rollouts
    hits = sum(llm.stats()["prefix_hit_tokens"] for llm in llms)
    assert total > 1000 and hits > 0


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear", "deepseek_v32"])
def test_speculative_config_greedy_equals_plain(kestrel, models, arch):
    """LLM(speculative_config=...) with the n-gram drafter: greedy tokens and log-probabilities equal the run without
    speculation bit for bit, and drafts were made and verified (a strong repetition penalty below 1 makes the random
    tiny model repeat itself, so prompt lookup finds matches)."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 9]}]
    params = kestrel.SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True,
                                    repetition_penalty=0.05)
    plain = kestrel.LLM(models[arch], max_model_len=128)
    spec = kestrel.LLM(models[arch], max_model_len=128,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: bits(v.logprob) for t, v in lw.items()} == {t: bits(v.logprob) for t, v in lg.items()}
    st = spec.stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_draft_tokens"] >= st["spec_decode_num_drafts"]
    assert 0 < st["spec_decode_num_accepted_tokens"] <= st["spec_decode_num_draft_tokens"]
    assert plain.stats()["spec_decode_num_drafts"] == 0


def test_speculative_config_errors_name_the_field(kestrel, models):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        kestrel.LLM(models["kimi_k3"], speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        kestrel.LLM(models["kimi_k3"], speculative_config={"method": "eagle9", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method 'dspark' needs 'model'"):
        kestrel.LLM(models["kimi_k3"], speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        kestrel.LLM(models["kimi_k3"], speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'dspark_target_layer_ids' names layer 3"):
        kestrel.LLM(models["deepseek_v32"], speculative_config={"method": "dspark", "num_speculative_tokens": 2,
                                                                "model": models["kimi_k3"] + "_dspark"})


@pytest.mark.parametrize("arch, method", [("kimi_k3", "dspark"), ("kimi_linear", "dspark"), ("deepseek_v32", "dspark"),
                                          ("deepseek_v32", "mtp")])
def test_model_drafters_greedy_equals_plain(kestrel, models, arch, method):
    """LLM(speculative_config=...) with make-model's DSpark drafter and DeepSeek-V3.2's own MTP layer: greedy
    tokens and log-probabilities equal the run without speculation bit for bit; drafts were made."""
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 9]}]
    params = kestrel.SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    cfg = {"method": method, "num_speculative_tokens": 3}
    if method == "dspark":
        cfg.update(model=models[arch] + "_dspark", draft_sample_method="probabilistic")
    plain = kestrel.LLM(models[arch], max_model_len=128)
    spec = kestrel.LLM(models[arch], max_model_len=128, speculative_config=cfg)
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert {t: bits(v.logprob) for t, v in lw.items()} == {t: bits(v.logprob) for t, v in lg.items()}
    st = spec.stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_draft_tokens"] > st["spec_decode_num_drafts"]


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    out = {}
    for arch in ("kimi_k3", "kimi_linear", "deepseek_v32"):
        d = tmp_path_factory.mktemp(arch + "_lora")
        subprocess.run([kestrel_bin(), "make-model", "--arch", arch, "--preset", "tiny", "--out", str(d / "m"),
                        "--lora-out", str(d / "a0"), "--lora-rank", "8"], check=True, capture_output=True,
                       timeout=120)
        out[arch] = (str(d / "m"), str(d / "a0"), d)
    return out


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear", "deepseek_v32"])
def test_lora_requests_batch_and_rl_loop(kestrel, lora_models, arch, capsys):
    """Adapters change the output; several adapters (and none) in one call equal each alone bit for bit; a
    rollout-then-score loop reloading the adapter with new weights every step scores with the rollout's bits."""
    model, template, tmp = lora_models[arch]
    llm = kestrel.LLM(model, max_model_len=128, enable_lora=True, max_lora_rank=8, max_loras=3, batch_invariant=True)
    adapters = [kestrel.LoRARequest(f"a{i}", i + 1, random_adapter(template, str(tmp / f"r{i}"), i)) for i in range(2)]
    p = kestrel.SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 40, 41, 42 + i]} for i in range(3)]
    loras = [None, adapters[0], adapters[1]]
    together = llm.generate(prompts, p, lora_request=loras)
    alone = [llm.generate(q, p, lora_request=r)[0] for q, r in zip(prompts, loras)]
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [bits(lp[t].logprob) for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == \
            [bits(lp[t].logprob) for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
    same_prompt = llm.generate([prompts[0]] * 3, p, lora_request=loras)
    assert len({bits(o.outputs[0].cumulative_logprob) for o in same_prompt}) == 3  # the adapters change the output
    assert llm.list_loras() == [1, 2]
    # The RL loop: rollouts through this step's weights, scored through the same weights after the update of the
    # other id.
    rng = random.Random(5)
    previous, lora, total = [], None, 0
    for step in range(100):
        lora = kestrel.LoRARequest("policy", 1 + step % 2, random_adapter(template, str(tmp / f"s{step}"), 100 + step))
        llm.load_lora(lora)
        if previous:
            scored = llm.score([r[0] for r in previous], [r[1] for r in previous], lora_request=[r[3] for r in previous])
            diffs = []
            for (prompt, tokens, lps, _), s in zip(previous, scored):
                assert s.token_ids == tokens
                assert [bits(x) for x in s.logprobs] == [bits(x) for x in lps], f"{arch} step {step}"
                diffs += [a - b for a, b in zip(lps, s.logprobs)]
                total += len(tokens)
            kl = sum(diffs) / len(diffs)
            assert kl == 0.0
            with capsys.disabled():
                print(f"\n[python-lora-rl] {arch} step {step:3d}: {len(previous)} sequences, {len(diffs)} tokens, "
                      f"KL {kl:.1f}", end="")
        rp = kestrel.SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 6), n=rng.randint(1, 2),
                                    seed=rng.randint(0, 2**31), logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": [rng.randint(1, 200) for _ in range(rng.randint(2, 20))]}
                             for _ in range(rng.randint(1, 3))], rp, lora_request=lora)
        previous = [(o.prompt_token_ids, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], lora)
                    for o in outs for c in o.outputs]
    with capsys.disabled():
        print(f"\n[python-lora-rl] {arch}: 100 steps, {total} tokens scored equal to the rollout bit for bit (KL 0.0)")
    assert total > 200
    assert llm.remove_lora(2) and llm.list_loras() == [1]


def test_lora_errors(kestrel, lora_models, tmp_path):
    model, template, _ = lora_models["deepseek_v32"]
    llm = kestrel.LLM(model, max_model_len=64, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="r = 8 is outside"):
        llm.generate("x", lora_request=kestrel.LoRARequest("a", 1, template))
    llm = kestrel.LLM(model, max_model_len=64, enable_lora=True, max_lora_rank=8, max_loras=1)
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("x", lora_request=kestrel.LoRARequest("a", 1, str(tmp_path)))
    bad = random_adapter(template, str(tmp_path / "bad"), 1)
    Path(bad, "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["embed_tokens"]}')
    with pytest.raises(ValueError, match="unknown target module 'embed_tokens'"):
        llm.generate("x", lora_request=kestrel.LoRARequest("a", 1, bad))
    with pytest.raises(ValueError, match="max_loras"):
        llm.generate(["x", "y"], lora_request=[kestrel.LoRARequest("a", 1, template),
                                               kestrel.LoRARequest("b", 2, template)])
    with pytest.raises(ValueError, match="lora_int_id"):
        kestrel.LoRARequest("a", 0, template)
    with pytest.raises(ValueError, match="max_lora_rank"):
        kestrel.LLM(model, enable_lora=True, max_lora_rank=65)
    # Still serving, with and without the adapter.
    assert llm.generate("x", kestrel.SamplingParams(max_tokens=2), lora_request=kestrel.LoRARequest("a", 1, template))
    assert llm.generate("x", kestrel.SamplingParams(max_tokens=2))
