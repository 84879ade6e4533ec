"""The peer of bench/gpu/kda_cuda_bench.cpp, measured in the same run on the same GPU: flash-linear-attention's
(fla) Triton KDA kernels on the shapes of the issue, timed with CUDA events.

- Prefill: chunk_kda, B=1, H=32, dk=dv=128, T = 4096 / 32768, one sequence from an fp32 initial state, the final
  state returned. Median of 20 calls after the first (compile and autotune) call and 3 warm-ups.
- Decode: one token for each of N = 1 / 64 / 256 sequences, H=32, d=128, fp32 state. "eager" is the median of 50
  calls, each timed alone after 10 warm-ups (it includes the Python and launch time the GPU waits for); "graph" is
  the median over 20 CUDA-graph replays of 64 captured calls, per call, after 3 warm-up replays (Kestrel's decode
  number is graph-replayed too). As in kda_cuda_bench, call l uses state set l % sets of a pool of at least 128 MB
  and its own inputs, so that the L2 cache does not hold the state. state_TBps counts N*H*d*d*4 bytes read plus
  the same written.

Gate variants, both on bf16 q/k/v, an fp32 gate and bf16 beta:
- gate=logspace: what the issue names: the gate already in log space (-exp(A_log) * softplus(f + dt_bias)),
  beta already in (0, 1), q and k already L2-normalised; none of that preprocessing is timed.
- gate=fused: the same work as kda_cuda_bench: raw gate with A_log and dt_bias, beta logits and raw q/k, with
  fla's use_gate_in_kernel, use_beta_sigmoid_in_kernel and use_qk_l2norm_in_kernel.
Decode APIs: api=public is fused_recurrent_kda (it allocates the output and a new final state each call);
api=inplace is fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd with ssm_state_indices and
inplace_final_state=True, which updates state slots of a pool in place the way kda_decode does.
Both gate variants compute the same function from the same raw inputs, so each case also prints the relative
difference of their outputs (bf16 rounding, about 1e-2, is expected), and of the in-place and public decodes.

The source is .peers/fla-src (bench/gpu/make_peers.sh), found through PYTHONPATH or next to this repository.
fla/__init__.py, fla/ops/__init__.py and fla/modules/__init__.py import every model, layer and op of fla (and
transformers); the KDA ops need none of that, so those three packages are registered as bare packages and only
fla.ops.kda and what it imports are loaded (if that fails, it falls back to a plain `import fla.ops.kda`; the info
line says which import was used). fla's files are not modified. FlashKDA and TileLang, optional backends fla would
dispatch to when installed, are switched off (FLA_FLASH_KDA=0, FLA_TILELANG=0): the peer is fla's Triton path.

Prints one line per measurement, `peer fla <op> key=value ...`. Exits 0 with `fla not available: <why>` when the
source is absent or does not import, 1 when a case failed, else 0.
Usage: PYTHONPATH=.peers/fla-src python3 bench/gpu/peers_kda.py
"""

import importlib
import importlib.machinery
import importlib.util
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

H, D = 32, 128
DECODE_NS = (1, 64, 256)
PREFILL_TS = (4096, 32768)
GRAPH_LAUNCHES = 64


def find_fla_package():
    spec = importlib.util.find_spec("fla")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    local = Path(__file__).resolve().parents[2] / ".peers" / "fla-src" / "fla"
    return local if local.is_dir() else None


def import_fla_kda(pkg):
    """Returns (fla.ops.kda, fla.ops.kda.fused_recurrent, how): first without running the heavy package __init__
    files; if that fails, through them, as a plain `import fla.ops.kda` would."""
    try:
        return (*import_fla_kda_bare(pkg), "bare-packages")
    except Exception as bare_error:
        print(f"peer fla info bare import failed ({type(bare_error).__name__}: {bare_error}); trying the package")
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
        kda = importlib.import_module("fla.ops.kda")
        return kda, importlib.import_module("fla.ops.kda.fused_recurrent"), "package"


def import_fla_kda_bare(pkg):
    init = (pkg / "__init__.py").read_text()
    version = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', init, re.M)
    for name, path in (("fla", pkg), ("fla.ops", pkg / "ops"), ("fla.modules", pkg / "modules")):
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
    sys.modules["fla"].__version__ = version.group(1) if version else "0"
    sys.modules["fla"].ops = sys.modules["fla.ops"]
    sys.modules["fla"].modules = sys.modules["fla.modules"]
    kda = importlib.import_module("fla.ops.kda")
    return kda, importlib.import_module("fla.ops.kda.fused_recurrent")


def rel_diff(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Peer:
    def __init__(self, torch, kda, recurrent):
        self.torch = torch
        self.chunk_kda = kda.chunk_kda
        self.fused_recurrent_kda = kda.fused_recurrent_kda
        self.fused_recurrent_kda_fwd = recurrent.fused_recurrent_kda_fwd
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(2026)
        self.failed = 0

    def normal(self, shape, mean=0.0, std=1.0, dtype=None):
        x = self.torch.randn(shape, device="cuda", dtype=self.torch.float32, generator=self.gen) * std + mean
        return x if dtype is None else x.to(dtype)

    def time_ms(self, fn):
        self.start.record()
        fn()
        self.stop.record()
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop)

    def inputs(self, tokens, A_log, dt_bias):
        """Raw model-like inputs (as kda_cuda_bench draws them) and their log-space counterparts."""
        torch, F = self.torch, self.torch.nn.functional
        bf16 = torch.bfloat16
        raw = {
            "q": self.normal((1, tokens, H, D)),
            "k": self.normal((1, tokens, H, D)),
            "v": self.normal((1, tokens, H, D), dtype=bf16),
            "g": self.normal((1, tokens, H, D)),
            "beta": self.normal((1, tokens, H), std=2.0, dtype=bf16),
        }
        log = {
            "q": F.normalize(raw["q"], dim=-1, eps=1e-6).to(bf16),
            "k": F.normalize(raw["k"], dim=-1, eps=1e-6).to(bf16),
            "v": raw["v"],
            "g": -torch.exp(A_log)[:, None] * F.softplus(raw["g"] + dt_bias.view(H, D)),
            "beta": torch.sigmoid(raw["beta"].float()).to(bf16),
        }
        raw["q"], raw["k"] = raw["q"].to(bf16), raw["k"].to(bf16)
        return {"logspace": log, "fused": raw}

    def gate_args(self, gate, A_log, dt_bias):
        if gate == "logspace":
            return {}
        return {"A_log": A_log, "dt_bias": dt_bias, "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True,
                "use_beta_sigmoid_in_kernel": True}

    def prefill(self, T):
        torch = self.torch
        A_log, dt_bias = self.normal((H,), 1.5, 0.5), self.normal((H * D,), -3.0, 1.0)
        data = self.inputs(T, A_log, dt_bias)
        h0 = self.normal((1, H, D, D), std=0.5)
        outputs = {}
        for gate in ("logspace", "fused"):
            x, extra = data[gate], self.gate_args(gate, A_log, dt_bias)
            label = f"peer fla chunk_kda gate={gate} T={T} H={H} d={D}"
            try:
                def call():
                    return self.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                          output_final_state=True, **extra)

                t0 = time.perf_counter()
                o, ht = call()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                for _ in range(3):
                    call()
                times = [self.time_ms(call) for _ in range(20)]
                ms = statistics.median(times)
                finite = bool(torch.isfinite(o).all().item() and torch.isfinite(ht).all().item())
                outputs[gate] = (o, ht)
                diff = ""
                if gate == "fused" and "logspace" in outputs:
                    diff = (f" rel_diff_vs_logspace_o={rel_diff(o, outputs['logspace'][0]):.2e}"
                            f" rel_diff_vs_logspace_state={rel_diff(ht, outputs['logspace'][1]):.2e}")
                print(f"{label} median_ms={ms:.4f} min_ms={min(times):.4f} Mtok_s={T / (ms * 1e-3) / 1e6:.2f}"
                      f" reps=20 first_call_s={first_s:.1f}{diff}{'' if finite else ' NON-FINITE OUTPUT'}")
            except Exception as e:  # one failing case must not hide the others
                self.fail(label, e)

    def decode(self, N):
        torch = self.torch
        slot_bytes = H * D * D * 4
        set_bytes = N * slot_bytes
        sets = min(max(-(-(256 << 20) // set_bytes), 2), 64)

        def state_tbps(us):
            return 2 * set_bytes / (us * 1e-6) / 1e12

        A_log, dt_bias = self.normal((H,), 1.5, 0.5), self.normal((H * D,), -3.0, 1.0)
        data = self.inputs(N * sets, A_log, dt_bias)
        pool = self.normal((N * sets, H, D, D), std=0.5)
        slots = torch.randperm(N * sets, generator=torch.Generator().manual_seed(N)).to("cuda", torch.int32)
        cu = torch.arange(N + 1, device="cuda", dtype=torch.int64)
        out = torch.empty((1, N * sets, H, D), device="cuda", dtype=torch.bfloat16)

        def step(gate, s):
            x = data[gate]
            return [x[n][:, s * N:(s + 1) * N] for n in ("q", "k", "v", "g", "beta")]

        def public(gate, s, h0):
            return self.fused_recurrent_kda(*step(gate, s), initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, **self.gate_args(gate, A_log, dt_bias))

        def inplace(s):
            return self.fused_recurrent_kda_fwd(*step("fused", s), initial_state=pool, inplace_final_state=True,
                                                output_final_state=True, cu_seqlens=cu,
                                                ssm_state_indices=slots[s * N:(s + 1) * N],
                                                out=out[:, s * N:(s + 1) * N],
                                                **self.gate_args("fused", A_log, dt_bias))

        cases = {
            ("public", "logspace"): lambda i: public("logspace", i % sets, pool[(i % sets) * N:(i % sets + 1) * N]),
            ("public", "fused"): lambda i: public("fused", i % sets, pool[(i % sets) * N:(i % sets + 1) * N]),
            ("inplace", "fused"): lambda i: inplace(i % sets),
        }
        try:
            h0 = pool.index_select(0, slots[:N].long())
            o_log, ht_log = public("logspace", 0, h0)
            o_fused, ht_fused = public("fused", 0, h0)
            inplace(0)
            torch.cuda.synchronize()
            print(f"peer fla fused_recurrent_kda check N={N} H={H} d={D}"
                  f" rel_diff_fused_vs_logspace_o={rel_diff(o_fused, o_log):.2e}"
                  f" rel_diff_fused_vs_logspace_state={rel_diff(ht_fused, ht_log):.2e}"
                  f" rel_diff_inplace_vs_public_o={rel_diff(out[:, :N], o_fused):.2e}"
                  f" rel_diff_inplace_vs_public_state={rel_diff(pool.index_select(0, slots[:N].long()), ht_fused):.2e}")
        except Exception as e:
            self.fail(f"peer fla fused_recurrent_kda check N={N}", e)

        for (api, gate), call in cases.items():
            label = f"peer fla fused_recurrent_kda api={api} gate={gate}"
            shape = f"N={N} H={H} d={D}"
            try:
                eager = [self.time_ms(lambda: call(i)) * 1e3 for i in range(60)][10:]
                us = statistics.median(eager)
                print(f"{label} mode=eager {shape} median_us={us:.2f} state_TBps={state_tbps(us):.3f}"
                      f" reps={len(eager)}")
                us = self.graph_us(call)
                print(f"{label} mode=graph {shape} median_us={us:.2f} state_TBps={state_tbps(us):.3f}"
                      f" launches={GRAPH_LAUNCHES} reps=20 sets={sets}")
            except Exception as e:
                self.fail(f"{label} {shape}", e)

    def graph_us(self, call):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(GRAPH_LAUNCHES):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(GRAPH_LAUNCHES):
                call(i)
        per_call = [self.time_ms(graph.replay) * 1e3 / GRAPH_LAUNCHES for _ in range(23)][3:]
        del graph
        return statistics.median(per_call)

    def fail(self, label, e):
        self.failed += 1
        print(f"{label} error={type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        traceback.print_exc(file=sys.stdout)


def main():
    # The peer is fla's own Triton path: never an optional CUTLASS (FlashKDA) or TileLang backend.
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    os.environ.setdefault("FLA_TILELANG", "0")
    pkg = find_fla_package()
    if pkg is None or not (pkg / "ops" / "kda" / "__init__.py").is_file():
        print("fla not available: no fla/ops/kda on PYTHONPATH nor in .peers/fla-src (run bench/gpu/make_peers.sh "
              "and carry .peers)")
        return 0
    commit_file = pkg.parent / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.is_file() else "unknown"
    try:
        import torch
        import triton

        if not torch.cuda.is_available():
            print("fla not available: torch sees no CUDA device")
            return 0
        kda, recurrent, how = import_fla_kda(pkg)
    except Exception as e:
        print(f"fla not available: import failed: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stdout)
        return 0
    print(f"peer fla info commit={commit} version={sys.modules['fla'].__version__} import={how} source={pkg}"
          f" torch={torch.__version__} triton={triton.__version__} cuda={torch.version.cuda}"
          f" device={torch.cuda.get_device_name(0).replace(' ', '_')}")
    peer = Peer(torch, kda, recurrent)
    with torch.inference_mode():
        for N in DECODE_NS:
            peer.decode(N)
        for T in PREFILL_TS:
            peer.prefill(T)
            torch.cuda.empty_cache()
    return 1 if peer.failed else 0


if __name__ == "__main__":
    sys.exit(main())
