"""Golden test of Kestrel's CPU reference forward pass against the independent NumPy model (golden_numpy.py).

For each architecture: `kestrel make-model --preset tiny`, then `kestrel generate` (greedy, --kv-cache-dtype auto)
with --dump-logits, and the dumped logits of every fed position (prefill and decode steps) are compared with a
float64 causal prefill of the same tokens. Three prompt regimes: "sparse" (longer than index_topk, so the indexer
really selects), "dense" (every position below index_topk) and "long" (crossing KDA chunk boundaries).

Bounds:
- REL_TOL: ||kestrel - golden|| / ||golden|| over all positions. Kestrel computes in fp32, the golden model in
  fp64 with the same exact FP8 steps; fp32 rounding through a few tiny layers gives errors around 1e-6, so
  1e-4 leaves room for accumulation-order differences while a wrong formula (a missing scale, a wrong RoPE
  layout, one wrong top-k selection) gives errors far above it.
- Greedy tokens must equal the golden argmax wherever the golden top-1/top-2 margin exceeds MARGIN.

Inputs are conditioned: the indexer's top-k (and the MoE router's choice) is a discrete decision, and where fp32
rounding noise could flip it (an indexer input within ~1e-6 of an e4m3 rounding midpoint whose code decides a
selection, or two scores that close), a correct fp32 implementation may select differently and the logits
diverge by far more than REL_TOL. The golden model's Audit finds such decisions; prompts come from a fixed
sequence of seeds and the first one whose run has none within AUDIT_MARGIN is compared.

Set KESTREL_BIN to the kestrel binary; the default is build/src/kestrel under the repository root.
"""

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kestrel_binary import kestrel_bin as _kestrel_bin

import golden_numpy

REPO = Path(__file__).resolve().parents[2]
ARCHS = ["kimi_k3", "kimi_linear", "deepseek_v32"]
REL_TOL = 1e-4
MARGIN = 1e-3
MAX_TOKENS = 8
SPARSE_PROMPT_LEN = 40
LONG_PROMPT_LEN = 130  # crosses two 64-token KDA chunk boundaries of Kestrel's chunked prefill
AUDIT_MARGIN = 5e-6  # fp32-vs-fp64 noise bound for the Audit; the flips seen so far needed 5e-7 to 2e-6
MAX_ATTEMPTS = 40
REGIMES = ["sparse", "dense", "long"]




def _run(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.fail(f"command failed ({res.returncode}): {' '.join(cmd)}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}")
    return res


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint dir, golden Model); checkpoints made once per module."""
    binary = _kestrel_bin()
    root = tmp_path_factory.mktemp("golden")
    out = {}
    for arch in ARCHS:
        ckpt = root / arch
        _run([binary, "make-model", "--arch", arch, "--preset", "tiny", "--out", str(ckpt), "--seed", "1"])
        out[arch] = (ckpt, golden_numpy.load_model(str(ckpt)))
    return out


def _generate(ckpt: Path, prompt, tmp: Path):
    binary = _kestrel_bin()
    logits_path, json_path = tmp / "l.npy", tmp / "o.json"
    _run([binary, "generate", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)),
          "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--kv-cache-dtype", "auto",
          "--dump-logits", str(logits_path), "--output-json", str(json_path)])
    with open(json_path) as f:
        result = json.load(f)
    return np.load(logits_path), result


def _report(kestrel, golden, fed, n_prompt, model):
    per_pos_abs = np.max(np.abs(kestrel - golden), axis=1)
    per_pos_rel = np.linalg.norm(kestrel - golden, axis=1) / np.linalg.norm(golden, axis=1)
    bad = np.nonzero(per_pos_rel > REL_TOL)[0]
    lines = [f"positions fed: {len(fed)} (prompt {n_prompt}); first position over REL_TOL: "
             f"{bad[0] if bad.size else 'none'}",
             "pos  token  max|abs err|  rel err   kestrel-argmax golden-argmax"]
    for p in range(len(fed)):
        lines.append(f"{p:3d} {fed[p]:6d}  {per_pos_abs[p]:11.3e}  {per_pos_rel[p]:9.2e}  "
                     f"{int(np.argmax(kestrel[p])):6d} {int(np.argmax(golden[p])):6d}")
    near = golden_numpy.Audit(10 * AUDIT_MARGIN)
    model.forward(fed, near)
    lines.append(f"decisions within {near.margin:g} (layer, kind, position, detail): {near.events[:20]}")
    return "\n".join(lines)


def _prompt_len(cfg, regime):
    if regime in ("sparse", "long"):
        n = SPARSE_PROMPT_LEN if regime == "sparse" else LONG_PROMPT_LEN
        if cfg.has_indexer:
            n = max(n, 2 * cfg.index_topk + 8)
        return n
    # dense: every fed position (prompt plus MAX_TOKENS - 1 generated) stays below index_topk
    limit = cfg.index_topk if cfg.has_indexer else 16
    return max(1, limit - MAX_TOKENS)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_kestrel_matches_golden(models, arch, regime, tmp_path):
    ckpt, model = models[arch]
    cfg = model.cfg
    assert cfg.arch == arch
    for attempt in range(MAX_ATTEMPTS):
        rng = np.random.default_rng([ARCHS.index(arch), REGIMES.index(regime), attempt])
        prompt = [int(t) for t in rng.integers(0, cfg.vocab, size=_prompt_len(cfg, regime))]
        kestrel, result = _generate(ckpt, prompt, tmp_path)
        assert result["prompt_ids"] == prompt
        output = [int(t) for t in result["output_ids"]]
        assert len(output) == MAX_TOKENS
        fed = prompt + output[:-1]
        audit = golden_numpy.Audit(AUDIT_MARGIN)
        golden = model.forward(fed, audit)
        if not audit.events:
            break
        print(f"{arch} {regime}: attempt {attempt} skipped, {len(audit.events)} decision(s) within the fp32 noise, "
              f"first {audit.events[0]}")
    else:
        pytest.fail(f"{arch} {regime}: no well-conditioned prompt in {MAX_ATTEMPTS} attempts")
    assert kestrel.dtype == np.float32
    assert kestrel.shape == (len(fed), cfg.vocab), f"dumped logits shape {kestrel.shape}"
    if cfg.has_indexer and regime == "dense":
        assert len(fed) <= cfg.index_topk
    if cfg.has_indexer and regime != "dense":
        assert len(fed) > cfg.index_topk
    rel = np.linalg.norm(kestrel - golden) / np.linalg.norm(golden)
    print(f"{arch} {regime}: attempt {attempt}, relative error {rel:.3e} over {len(fed)} positions")
    assert rel <= REL_TOL, f"{arch} {regime}: relative error {rel:.3e} > {REL_TOL}\n" + _report(
        kestrel, golden, fed, len(prompt), model)

    n_prompt = len(prompt)
    for i, tok in enumerate(output):
        row = golden[n_prompt - 1 + i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > MARGIN:
            assert tok == int(np.argmax(row)), (
                f"{arch} {regime}: generated token {i} is {tok}, golden argmax {int(np.argmax(row))} "
                f"(margin {top2[1] - top2[0]:.3e})\n" + _report(kestrel, golden, fed, n_prompt, model))

    if cfg.has_indexer and regime != "dense":
        # The comparison only tests the sparse selection if attending to everything would give other logits.
        dense_model = copy.copy(model)
        dense_model.cfg = copy.copy(cfg)
        dense_model.cfg.index_topk = len(fed)
        dense = dense_model.forward(fed)
        gap = np.linalg.norm(dense - golden) / np.linalg.norm(golden)
        assert gap > 10 * REL_TOL, f"{arch}: sparse and dense attention differ only by {gap:.2e}"
