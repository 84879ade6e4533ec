"""The peers of bench/gpu/dsa_decode_bench.cpp, measured in the same run on the same GPU: DeepGEMM's FP8 indexer
logits and FlashMLA's sparse MLA over the FP8 latent cache, both built from source by
bench/gpu/build_peers_h200.sh (into KESTREL_PEERS_BUILD, default build-peers/ in this repository).

Shapes (the seed's, as in dsa_decode_bench): top-2048, 64-token pages, one query token per request (n_q = 1),
contexts L = 8K / 32K / 128K, batches B = 1 / 32 / 64, MLA heads 96 and 128, indexer heads H_I = 32 and 64 of
dimension 128. All inputs are random (Gaussian values, quantised as each library expects; never zeros).
- `deepgemm paged_mqa_logits`: deep_gemm.fp8_paged_mqa_logits, the decode indexer: fp32 logits [B, L] of
  sum_j w_j relu(q_j . k) over a paged FP8 key cache (per page: 64 x 128 e4m3 codes, then 64 fp32 scales, the same
  132 bytes per token as Kestrel's index-key pages), with its schedule from get_paged_mqa_logits_metadata (timed
  on its own as `paged_mqa_logits_metadata`: once per step, shared by the layers). Kestrel's counterpart is
  index_scores_decode (the "scores fp8" column). key_TBps counts the keys read (B L 132 bytes, as Kestrel's "fp8
  scan TB/s"); TBps adds the logits written (B L 4 bytes).
- `flashmla sparse_decode`: flash_mla.flash_mla_with_kvcache with indices and is_fp8_kvcache, FlashMLA's 656-byte
  V3.2 token layout (512 e4m3 codes, 4 fp32 tile scales, 64 bf16 rope values; made by FlashMLA's own
  tests/quant.py), bf16 queries [B, 1, h_q, 576], softmax scale 0.1352338 as Kestrel's benchmark. Indices are each
  request's 2048 positions (distinct, ascending, uniform over its context) turned into cache slots through its
  page table (page * 64 + offset), as FlashMLA's tests and vLLM do. On SM90 FlashMLA takes h_q = 64 or 128: H = 96
  runs as h_q = 128 (padded heads, as vLLM pads), labelled h_q=128. Kestrel's counterpart is sparse_mla_decode
  (576-byte latent rows). kv_TBps counts the cache rows read (B 2048 656 bytes); TFLOPs counts 2 h_q 2048
  (576 + 512) per request, FlashMLA's convention.
- `deepgemm mqa_logits` (prefill indexer, no paging) and `flashmla sparse_prefill` (flash_mla_sparse_fwd: bf16
  queries [S, h_q, 576], a bf16 latent [L, 1, 576] as FlashMLA's prefill kernel takes it, int32 indices
  [S, 1, 2048], d_v 512): one prompt chunk of S = 4096 / 1024 query tokens at the end of a context of
  L = 8K / 32K / 128K, causal (query t at position L - S + t selects 2048 distinct positions <= its own), the
  shapes of dsa_prefill_bench, Kestrel's counterpart (its "scores" and "sparse MLA" columns; Kestrel reads the FP8
  latent, FlashMLA's prefill the bf16 one). TFLOPs: DeepGEMM 2 H_I 128 per causal (query, key) pair, FlashMLA
  2 h_q 2048 (576 + 512) per query, as dsa_prefill_bench counts them. FlashMLA's prefill first checks the last
  query's output against a float reference over its selected rows (rel_diff_out, informational).
- `torch dsa_decode`: one DSA decode layer step in plain PyTorch eager (no custom kernels), the "PyTorch
  implementation" of issue 7's ratio, on bf16 paged caches: the request's index keys (bf16 [L, 128]) gathered
  through its page table (index_select of whole pages), logits = q [B, H_I, 128] . k (bmm, bf16 out), relu, the
  weighted head sum with fp32 weights [B, H_I] (bmm in fp32), torch.topk(min(2048, L)), the selected latent rows
  (bf16 [c ; k_pe], 576 per token) gathered through the page table (slot = page * 64 + offset), then absorbed
  attention for H heads (q_abs [B, H, 576] times the softmax scale in bf16, scores = q . rows^T in bf16, softmax in
  fp32 as DeepSeek's reference model.py does, out = p . rows[:, :512]). Every H in --heads runs with every H_I in
  --index-heads. key_TBps counts the bf16 index keys read (B L 256 bytes); TBps adds the selected latent rows
  (B k 1152 bytes). Kestrel's counterpart: the DSA step of dsa_decode_bench / mla_decode_bench.
- `torch dense_mla_decode`: the same absorbed attention over the whole bf16 latent context, gathered through the
  page table. kv_TBps counts the latent read (B L 1152 bytes). Kestrel's counterpart: mla_decode_bench's dense
  bf16 table.
  The two PyTorch sections check request 0 of set 0 of each case against a float64 reference built
  independently (page by page): the indexer scores (rel_diff_scores), the recall of the top-k against the float64
  top-k (topk_recall; near-ties can swap through the bf16 logits), the output over the path's own selection
  (rel_diff_out, the attention arithmetic alone) and over the float64 selection (rel_diff_out_ref_topk). They run
  before the library sections (a crash in a library, as DeepGEMM's paged logits segfaulting in session 3, ends the
  process), and free their caches before the next case. Their memory: per case one set of caches when a single
  set is past POOL_BYTES_CAP (B = 64, L = 128K: 11.8 GB of bf16 latent + index keys for DSA), else at most the cap,
  plus the intermediates of a call (dense at B = 64, L = 128K, H = 128: the gathered latent 9.7 GB, the [B, H, L]
  scores 2.1 GB in bf16 and 4.3 GB in fp32, the bf16 probabilities 2.1 GB), once for eager and once more in the
  graph's memory pool: about 60 GB at the largest case by that count (not yet measured).
  With `--device cpu` only these two sections run (eager, two sets): a smoke test of the code at small shapes.

Timing as dsa_decode_bench: CUDA events, medians of 20 after 3 warm-ups, and every call on another set of request
caches (page tables into a pool of sets), with enough sets that the rotated caches are at least 600 MB and the
rows the calls read at least 240 MB, so that they come from memory, not the 50-60 MB L2. "eager" times each
Python call alone (it includes the host time of the call: tens of microseconds, which dominate at B = 1);
"graph" is the median over 20 replays (after 3) of a CUDA graph of one call per set (at most 256), per call: the
kernels' own time, the number to hold against Kestrel's. The prefill kernels run for milliseconds: eager only,
median of 10. Each decode case first checks one request's output against a float reference of the same quantised
inputs (rel_diff, informational). The PyTorch sections' eager line is the number a serving stack that runs these
ops one by one gets; their graph line is the same ops replayed from a CUDA graph.

Prints one line per measurement, `peer <library> <op> key=value ...`. Exits 0 with `<library> not available: <why>`
for a peer that is not built or does not import, 1 when a case failed, else 0.
Usage: python3 bench/gpu/peers_dsa.py [--contexts 8192,32768,131072] [--batches 1,32,64] [--heads 96,128]
       [--index-heads 32,64] [--prefill-queries 4096,1024] [--prefill-contexts 8192,32768,131072] [--sections flashmla_decode,deepgemm_paged,deepgemm_prefill,flashmla_prefill,
       torch_dsa_decode,torch_dense_mla_decode] [--device cuda|cpu]
The library sections need contexts that are multiples of 256 and at least 2048; the PyTorch sections take any
multiple of 64 (shorter than 2048: every token is selected). CPU smoke test:
       python3 bench/gpu/peers_dsa.py --device cpu --sections torch_dsa_decode,torch_dense_mla_decode \
           --contexts 256,4096 --batches 2 --heads 4 --index-heads 2
"""

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

DEVICE = "cuda"
PAGE = 64
TOPK = 2048
LATENT = 576
VALUE = 512
INDEX_DIM = 128
INDEX_KEY_BYTES = INDEX_DIM + 4
FLASHMLA_TOKEN_BYTES = 656
SOFTMAX_SCALE = 0.1352338
ITERS, WARM = 20, 3
PREFILL_ITERS = 10
ROTATED_BYTES = 600e6  # whole request caches rotated, as dsa_decode_bench
TOUCHED_BYTES = 240e6  # bytes the rotated calls read, several times the L2
POOL_BYTES_CAP = 20e9
GRAPH_MAX_LAUNCHES = 256
TEMPLATE_PAGES = 64  # distinct random pages, copied over the pool
TORCH_SECTIONS = ("torch_dsa_decode", "torch_dense_mla_decode")
SECTIONS = ("flashmla_decode", "deepgemm_paged", "deepgemm_prefill", "flashmla_prefill", *TORCH_SECTIONS)
BF16_BYTES = 2


def int_list(text):
    return [int(v) for v in text.split(",") if v]


def build_dir():
    return Path(os.environ.get("KESTREL_PEERS_BUILD", Path(__file__).resolve().parents[2] / "build-peers"))


def commit_of(folder):
    f = folder / "COMMIT"
    return f.read_text().strip() if f.is_file() else "unknown"


def load_flashmla():
    """Returns (flash_mla, its tests/quant.py module, commit) from the build folder."""
    d = build_dir() / "flashmla"
    if not list((d / "flash_mla").glob("cuda*.so")):
        raise FileNotFoundError(f"no built FlashMLA in {d} (run bench/gpu/build_peers_h200.sh)")
    sys.path.insert(0, str(d))
    import flash_mla

    spec = importlib.util.spec_from_file_location("flashmla_tests_quant", d / "tests" / "quant.py")
    quant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quant)
    return flash_mla, quant, commit_of(d)


def load_deepgemm():
    d = build_dir() / "deepgemm"
    if not list((d / "deep_gemm").glob("_C*.so")):
        raise FileNotFoundError(f"no built DeepGEMM in {d} (run bench/gpu/build_peers_h200.sh)")
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(build_dir() / "deepgemm-jit"))
    sys.path.insert(0, str(d))
    import deep_gemm

    return deep_gemm, commit_of(d)


def rel_diff(got, ref):
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------- PyTorch eager peer
def absorbed_attention(torch, q_abs, rows):
    """Absorbed MLA for one query token: q_abs bf16 [B, H, 576], rows bf16 [B, n, 576] -> bf16 [B, H, 512]."""
    scores = torch.bmm(q_abs * SOFTMAX_SCALE, rows.transpose(1, 2))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(torch.bfloat16)
    return torch.bmm(p, rows[:, :, :VALUE])


def torch_dsa_decode_step(torch, q_index, weights, q_abs, index_pool, latent_pool, table, k):
    """One DSA decode layer step on paged bf16 caches (pools [pages, 64, dim], table int32 [B, pages]):
    returns the attention output [B, H, 512], the indexer scores [B, L] and the selected positions [B, k]."""
    B, pages = table.shape
    keys = index_pool.index_select(0, table.view(-1)).view(B, pages * PAGE, INDEX_DIM)
    logits = torch.bmm(q_index, keys.transpose(1, 2)).relu_()
    scores = torch.bmm(weights.unsqueeze(1), logits.float()).squeeze(1)
    pos = torch.topk(scores, k, dim=1, sorted=False).indices
    slots = table.gather(1, pos // PAGE).long() * PAGE + pos % PAGE
    rows = latent_pool.view(-1, LATENT).index_select(0, slots.view(-1)).view(B, k, LATENT)
    return absorbed_attention(torch, q_abs, rows), scores, pos


def torch_dense_mla_step(torch, q_abs, latent_pool, table):
    """Absorbed MLA over every token of each request's paged bf16 latent: [B, H, 512]."""
    B, pages = table.shape
    rows = latent_pool.index_select(0, table.view(-1)).view(B, pages * PAGE, LATENT)
    return absorbed_attention(torch, q_abs, rows)


def reference_rows(torch, pool, table_row):
    """One request's cache rows in float64, page by page in table order: [L, dim]."""
    return torch.cat([pool[page] for page in table_row.tolist()]).double()


def reference_attention(torch, q_abs, rows):
    """float64 absorbed MLA of one request: q_abs [H, 576], rows float64 [n, 576] -> [H, 512]."""
    p = torch.softmax(q_abs.double() @ rows.T * SOFTMAX_SCALE, dim=-1)
    return p @ rows[:, :VALUE]


class Bench:
    def __init__(self, torch):
        self.torch = torch
        self.on_cuda = torch.device(DEVICE).type == "cuda"
        if self.on_cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.stop = torch.cuda.Event(enable_timing=True)
        self.gen = torch.Generator(device=DEVICE)
        self.gen.manual_seed(2026)
        self.failed = 0

    # ------------------------------------------------------------------ helpers
    def randn(self, shape, dtype=None):
        x = self.torch.randn(shape, device=DEVICE, dtype=self.torch.float32, generator=self.gen)
        return x if dtype is None else x.to(dtype)

    def quantize_ue8m0(self, x):
        """Per-row e4m3 codes and power-of-two fp32 scales (amax floored at 1e-4), as Kestrel's quantize_fp8_ue8m0."""
        torch = self.torch
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        return (x / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)

    def sets_for(self, set_bytes, touched_bytes):
        wanted = max(2, math.ceil(ROTATED_BYTES / set_bytes), math.ceil(TOUCHED_BYTES / touched_bytes))
        return max(2, min(wanted, int(POOL_BYTES_CAP // set_bytes)))

    def tiled_pool(self, template, pages):
        """A pool of `pages` pages (rounded up to whole templates) filled with copies of the template's pages."""
        n = template.shape[0]
        pool = self.torch.empty((-(-pages // n) * n, *template.shape[1:]), device=DEVICE, dtype=template.dtype)
        pool.view(-1, *template.shape).copy_(template.expand(pool.shape[0] // n, *template.shape))
        return pool

    def page_tables(self, pool_pages, sets, B, pages):
        """One shuffled permutation of the pool cut into per-set, per-request page tables: int32 [sets, B, pages]."""
        perm = self.torch.randperm(pool_pages, device=DEVICE, generator=self.gen)[: sets * B * pages]
        return perm.view(sets, B, pages).to(self.torch.int32)

    def time_ms(self, fn):
        if not self.on_cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        self.start.record()
        fn()
        self.stop.record()
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop)

    def eager_us(self, call, iters=ITERS, warm=WARM):
        for i in range(warm):
            call(i)
        times = [self.time_ms(lambda: call(warm + i)) * 1e3 for i in range(iters)]
        return statistics.median(times), min(times)

    def graph_us(self, call, launches):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(launches):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(launches):
                call(i)
        per_call = [self.time_ms(graph.replay) * 1e3 / launches for _ in range(ITERS + WARM)][WARM:]
        del graph
        return statistics.median(per_call)

    def fail(self, label, e):
        self.failed += 1
        print(f"{label} error={type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        traceback.print_exc(file=sys.stdout)

    def timed_modes(self, label, call, sets, rate):
        """Prints the eager and the graph line of one case (the eager one only off CUDA); rate(us) gives the rate
        fields."""
        try:
            us, best = self.eager_us(call)
            print(f"{label} mode=eager median_us={us:.2f} min_us={best:.2f} {rate(us)} sets={sets} reps={ITERS}")
        except Exception as e:
            self.fail(f"{label} mode=eager", e)
        if not self.on_cuda:
            return
        launches = min(sets, GRAPH_MAX_LAUNCHES)
        try:
            us = self.graph_us(call, launches)
            print(f"{label} mode=graph median_us={us:.2f} {rate(us)} sets={sets} launches={launches} reps={ITERS}")
        except Exception as e:
            self.fail(f"{label} mode=graph", e)

    # ------------------------------------------------------------------ PyTorch eager
    def torch_sets(self, set_bytes, touched_bytes):
        """As sets_for, but one set when a single set is past POOL_BYTES_CAP (gigabytes: far past the L2), and two
        off CUDA (a smoke test: no L2 to defeat)."""
        if not self.on_cuda:
            return 2
        wanted = max(2, math.ceil(ROTATED_BYTES / set_bytes), math.ceil(TOUCHED_BYTES / touched_bytes))
        return max(1, min(wanted, int(POOL_BYTES_CAP // set_bytes)))

    def bf16_pool(self, pages, dim):
        """A page pool bf16 [pages, 64, dim] of Gaussian values."""
        pool = self.torch.empty((pages, PAGE, dim), device=DEVICE, dtype=self.torch.bfloat16)
        return pool.normal_(generator=self.gen)

    def synchronize(self):
        if self.on_cuda:
            self.torch.cuda.synchronize()

    def release(self):
        if self.on_cuda:
            self.torch.cuda.empty_cache()

    def torch_dsa_decode(self, B, L, heads, index_heads):
        torch = self.torch
        pages = L // PAGE
        k = min(TOPK, L)
        key_bytes = B * L * INDEX_DIM * BF16_BYTES
        touched = key_bytes + B * k * LATENT * BF16_BYTES
        sets = self.torch_sets(B * L * (INDEX_DIM + LATENT) * BF16_BYTES, touched)
        index_pool = self.bf16_pool(sets * B * pages, INDEX_DIM)
        latent_pool = self.bf16_pool(sets * B * pages, LATENT)
        tables = self.page_tables(index_pool.shape[0], sets, B, pages)
        for H in heads:
            for HI in index_heads:
                label = f"peer torch dsa_decode B={B} L={L} H={H} HI={HI} D={INDEX_DIM} k={k}"
                try:
                    q_index = self.randn((B, HI, INDEX_DIM), torch.bfloat16)
                    weights = self.randn((B, HI)) * 0.01
                    q_abs = self.randn((B, H, LATENT), torch.bfloat16)

                    def call(i):
                        return torch_dsa_decode_step(torch, q_index, weights, q_abs, index_pool, latent_pool,
                                                     tables[i % sets], k)

                    t0 = time.perf_counter()
                    out, scores, pos = call(0)
                    self.synchronize()
                    first_s = time.perf_counter() - t0
                    # Request 0 of set 0 against float64 on the same bf16 values.
                    keys = reference_rows(torch, index_pool, tables[0, 0])
                    ref_scores = (torch.relu(q_index[0].double() @ keys.T) * weights[0].double()[:, None]).sum(0)
                    ref_pos = ref_scores.topk(k).indices
                    rows = reference_rows(torch, latent_pool, tables[0, 0])
                    print(f"{label} check rel_diff_scores={rel_diff(scores[0], ref_scores):.2e}"
                          f" topk_recall={torch.isin(pos[0], ref_pos).double().mean().item():.4f}"
                          f" rel_diff_out={rel_diff(out[0], reference_attention(torch, q_abs[0], rows[pos[0]])):.2e}"
                          f" rel_diff_out_ref_topk="
                          f"{rel_diff(out[0], reference_attention(torch, q_abs[0], rows[ref_pos])):.2e}"
                          f" first_call_s={first_s:.1f}")
                    del out, scores, pos, keys, ref_scores, ref_pos, rows
                except Exception as e:
                    self.fail(label, e)
                    continue

                def rate(us):
                    return (f"key_TBps={key_bytes / (us * 1e-6) / 1e12:.3f}"
                            f" TBps={touched / (us * 1e-6) / 1e12:.3f}")

                self.timed_modes(label, call, sets, rate)
        del index_pool, latent_pool, tables

    def torch_dense_mla_decode(self, B, L, heads):
        torch = self.torch
        pages = L // PAGE
        kv_bytes = B * L * LATENT * BF16_BYTES
        sets = self.torch_sets(kv_bytes, kv_bytes)
        latent_pool = self.bf16_pool(sets * B * pages, LATENT)
        tables = self.page_tables(latent_pool.shape[0], sets, B, pages)
        for H in heads:
            label = f"peer torch dense_mla_decode B={B} L={L} H={H}"
            try:
                q_abs = self.randn((B, H, LATENT), torch.bfloat16)

                def call(i):
                    return torch_dense_mla_step(torch, q_abs, latent_pool, tables[i % sets])

                t0 = time.perf_counter()
                out = call(0)
                self.synchronize()
                first_s = time.perf_counter() - t0
                ref = reference_attention(torch, q_abs[0], reference_rows(torch, latent_pool, tables[0, 0]))
                print(f"{label} check rel_diff_out={rel_diff(out[0], ref):.2e} first_call_s={first_s:.1f}")
                del out, ref
            except Exception as e:
                self.fail(label, e)
                continue

            def rate(us):
                return f"kv_TBps={kv_bytes / (us * 1e-6) / 1e12:.3f}"

            self.timed_modes(label, call, sets, rate)
        del latent_pool, tables

    # ------------------------------------------------------------------ DeepGEMM
    def deepgemm_paged(self, dg, B, L, index_heads):
        torch = self.torch
        pages = L // PAGE
        set_bytes = B * L * INDEX_KEY_BYTES
        sets = self.sets_for(set_bytes, set_bytes)
        # Template pages: 64 x 128 codes, then 64 fp32 scales (DeepGEMM's fused layout; Kestrel's index-key page).
        codes, scales = self.quantize_ue8m0(self.randn((TEMPLATE_PAGES * PAGE, INDEX_DIM)))
        template = torch.cat([codes.view(torch.uint8).reshape(TEMPLATE_PAGES, PAGE * INDEX_DIM),
                              scales.view(torch.uint8).reshape(TEMPLATE_PAGES, PAGE * 4)], dim=1)
        pool = self.tiled_pool(template, sets * B * pages)
        cache = pool.view(pool.shape[0], PAGE, 1, INDEX_KEY_BYTES)
        tables = self.page_tables(pool.shape[0], sets, B, pages)
        ctx = torch.full((B, 1), L, device=DEVICE, dtype=torch.int32)
        num_sms = dg.get_num_sms()
        shape = f"B={B} L={L}"
        try:
            schedule = dg.get_paged_mqa_logits_metadata(ctx, PAGE, num_sms)
            us, best = self.eager_us(lambda i: dg.get_paged_mqa_logits_metadata(ctx, PAGE, num_sms))
            print(f"peer deepgemm paged_mqa_logits_metadata {shape} mode=eager median_us={us:.2f} min_us={best:.2f}"
                  f" num_sms={num_sms}")
        except Exception as e:
            self.fail(f"peer deepgemm paged_mqa_logits_metadata {shape}", e)
            return
        for HI in index_heads:
            label = f"peer deepgemm paged_mqa_logits {shape} HI={HI} D={INDEX_DIM}"
            try:
                q_codes, _ = self.quantize_ue8m0(self.randn((B, 1, HI, INDEX_DIM)))
                weights = self.randn((B, HI)) * 0.01

                def call(i):
                    return dg.fp8_paged_mqa_logits(q_codes, cache, weights, ctx, tables[i % sets], schedule, L, False)

                t0 = time.perf_counter()
                logits = call(0)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                # Request 0 of set 0 against a float reference on the same codes and scales.
                rows = pool[tables[0, 0].long()]
                k = (rows[:, : PAGE * INDEX_DIM].contiguous().view(torch.float8_e4m3fn).float().view(L, INDEX_DIM)
                     * rows[:, PAGE * INDEX_DIM:].contiguous().view(torch.float32).view(L, 1))
                ref = (torch.relu(q_codes[0, 0].float() @ k.T) * weights[0, :, None]).sum(0)
                print(f"{label} check rel_diff={rel_diff(logits[0, :L], ref):.2e} first_call_s={first_s:.1f}")
            except Exception as e:
                self.fail(label, e)
                continue

            def rate(us):
                return (f"key_TBps={set_bytes / (us * 1e-6) / 1e12:.3f}"
                        f" TBps={(set_bytes + B * L * 4) / (us * 1e-6) / 1e12:.3f}")

            self.timed_modes(label, call, sets, rate)
        del pool, cache, tables

    def deepgemm_prefill(self, dg, S, L, index_heads):
        torch = self.torch
        kv_codes, kv_scales = self.quantize_ue8m0(self.randn((L, INDEX_DIM)))
        ks = torch.zeros(S, device=DEVICE, dtype=torch.int32)
        ke = torch.arange(L - S + 1, L + 1, device=DEVICE, dtype=torch.int32)
        pairs = int((ke - ks).sum().item())
        for HI in index_heads:
            label = f"peer deepgemm mqa_logits S={S} L={L} HI={HI} D={INDEX_DIM} clean_logits=0"
            try:
                q_codes, _ = self.quantize_ue8m0(self.randn((S, HI, INDEX_DIM)))
                weights = self.randn((S, HI)) * 0.01

                def call(i):
                    return dg.fp8_mqa_logits(q_codes, (kv_codes, kv_scales), weights, ks, ke, False)

                t0 = time.perf_counter()
                call(0)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                us, best = self.eager_us(call, PREFILL_ITERS)
                print(f"{label} mode=eager median_us={us:.1f} min_us={best:.1f}"
                      f" TFLOPs={2 * pairs * HI * INDEX_DIM / (us * 1e-6) / 1e12:.1f} reps={PREFILL_ITERS}"
                      f" first_call_s={first_s:.1f}")
            except Exception as e:
                self.fail(label, e)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ FlashMLA
    def flashmla_decode(self, fm, quant, B, L, heads):
        torch = self.torch
        pages = L // PAGE
        set_bytes = B * L * FLASHMLA_TOKEN_BYTES
        touched = B * TOPK * FLASHMLA_TOKEN_BYTES
        sets = self.sets_for(set_bytes, touched)
        layout = quant.FP8KVCacheLayout.V32_FP8Sparse
        template = quant.quantize_k_cache(self.randn((TEMPLATE_PAGES, PAGE, 1, LATENT), torch.bfloat16), layout)
        pool = self.tiled_pool(template.contiguous().view(torch.uint8), sets * B * pages)
        cache = pool.view(torch.float8_e4m3fn)
        tables = self.page_tables(pool.shape[0], sets, B, pages)
        indices = torch.empty((sets, B, 1, TOPK), device=DEVICE, dtype=torch.int32)
        for s in range(sets):
            pos = torch.rand((B, L), device=DEVICE, generator=self.gen).topk(TOPK, dim=1).indices.sort(dim=1).values
            indices[s, :, 0] = (tables[s].long().gather(1, pos // PAGE) * PAGE + pos % PAGE).to(torch.int32)
        for H in heads:
            h_q = 128 if H == 96 else H
            label = f"peer flashmla sparse_decode B={B} L={L} H={H} k={TOPK} h_q={h_q}"
            if h_q not in (64, 128):
                print(f"{label} not available: FlashMLA's SM90 sparse decode takes 64 or 128 heads")
                continue
            try:
                q = self.randn((B, 1, h_q, LATENT), torch.bfloat16)
                schedule = fm.get_mla_metadata()[0]

                def call(i):
                    return fm.flash_mla_with_kvcache(q, cache, None, None, VALUE, schedule, None,
                                                     softmax_scale=SOFTMAX_SCALE, causal=False, is_fp8_kvcache=True,
                                                     indices=indices[i % sets])

                t0 = time.perf_counter()
                out, lse = call(0)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                # Request 0 of set 0 against a float reference on FlashMLA's own dequantisation of the rows.
                rows = pool.view(-1, FLASHMLA_TOKEN_BYTES)[indices[0, 0, 0].long()].view(torch.float8_e4m3fn)
                k = quant.dequantize_k_cache(rows.view(TOPK, 1, 1, FLASHMLA_TOKEN_BYTES), layout).float().view(TOPK, LATENT)
                scores = (q[0, 0].float() @ k.T) * SOFTMAX_SCALE
                ref_out = torch.softmax(scores, dim=-1) @ k[:, :VALUE]
                lse_diff = (lse[0, :, 0] - torch.logsumexp(scores, dim=-1)).abs().max().item()
                print(f"{label} check rel_diff_out={rel_diff(out[0, 0], ref_out):.2e} max_abs_diff_lse={lse_diff:.2e}"
                      f" first_call_s={first_s:.1f}")
            except Exception as e:
                self.fail(label, e)
                continue

            def rate(us):
                return (f"kv_TBps={touched / (us * 1e-6) / 1e12:.3f}"
                        f" TFLOPs={2 * h_q * B * TOPK * (LATENT + VALUE) / (us * 1e-6) / 1e12:.1f}")

            self.timed_modes(label, call, sets, rate)
        del pool, cache, tables, indices

    def flashmla_prefill(self, fm, S, L, heads):
        torch = self.torch
        kv = self.randn((L, 1, LATENT), torch.bfloat16)
        # Query t sits at position L - S + t and picks 2048 distinct positions <= its own.
        indices = torch.empty((S, 1, TOPK), device=DEVICE, dtype=torch.int32)
        cols = torch.arange(L, device=DEVICE)
        for r0 in range(0, S, 256):
            rows = torch.arange(r0, min(S, r0 + 256), device=DEVICE)
            r = torch.rand((rows.numel(), L), device=DEVICE, generator=self.gen)
            r.masked_fill_(cols[None, :] > (L - S + rows)[:, None], -1.0)
            indices[r0:r0 + rows.numel(), 0] = r.topk(TOPK, dim=1).indices.sort(dim=1).values.to(torch.int32)
        for H in heads:
            h_q = 128 if H == 96 else H
            label = f"peer flashmla sparse_prefill S={S} L={L} H={H} k={TOPK} h_q={h_q}"
            try:
                q = self.randn((S, h_q, LATENT), torch.bfloat16)

                def call(i):
                    return fm.flash_mla_sparse_fwd(q, kv, indices, SOFTMAX_SCALE, VALUE)

                t0 = time.perf_counter()
                out = call(0)[0]
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                # The last query against a float reference over its selected rows.
                rows = kv[indices[S - 1, 0].long(), 0].float()
                p = torch.softmax((q[S - 1].float() @ rows.T) * SOFTMAX_SCALE, dim=-1)
                print(f"{label} check rel_diff_out={rel_diff(out[S - 1], p @ rows[:, :VALUE]):.2e}"
                      f" first_call_s={first_s:.1f}")
                us, best = self.eager_us(call, PREFILL_ITERS)
                print(f"{label} mode=eager median_us={us:.1f} min_us={best:.1f}"
                      f" TFLOPs={2 * h_q * S * TOPK * (LATENT + VALUE) / (us * 1e-6) / 1e12:.1f}"
                      f" reps={PREFILL_ITERS} first_call_s={first_s:.1f}")
            except Exception as e:
                self.fail(label, e)
        del kv, indices
        torch.cuda.empty_cache()


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int_list, default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=int_list, default=[1, 32, 64])
    parser.add_argument("--heads", type=int_list, default=[96, 128])
    parser.add_argument("--index-heads", type=int_list, default=[32, 64])
    parser.add_argument("--prefill-queries", type=int_list, default=[4096, 1024])
    parser.add_argument("--prefill-contexts", type=int_list, default=[8192, 32768, 131072])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the PyTorch sections")
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    torch_sections = [s for s in sections if s in TORCH_SECTIONS]
    library_sections = [s for s in sections if s not in TORCH_SECTIONS]
    for L in (args.contexts if library_sections else []) + args.prefill_contexts:
        if L % 256 or L < TOPK:
            parser.error(f"context {L}: must be a multiple of 256 and at least {TOPK}")
    for S in args.prefill_queries:
        if S < 1 or S > min(args.prefill_contexts) - TOPK:
            parser.error(f"prefill queries {S}: must be 1 .. {min(args.prefill_contexts) - TOPK} (every query sees"
                         f" at least {TOPK} positions)")
    for L in args.contexts:
        if L <= 0 or L % PAGE:
            parser.error(f"context {L}: must be a positive multiple of {PAGE}")

    try:
        import torch
    except Exception as e:
        if library_sections:
            print(f"flashmla not available: no torch ({e})\ndeepgemm not available: no torch ({e})")
        if torch_sections:
            print(f"torch not available: no torch ({e})")
        return 0
    DEVICE = args.device
    on_cuda = torch.device(DEVICE).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        torch_sections = []
        print("torch not available: torch sees no CUDA device")
    peers = {}
    if library_sections:
        if not on_cuda or not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            why = (f"--device {DEVICE}" if not on_cuda else "torch sees no CUDA device"
                   if not torch.cuda.is_available() else "the GPU is not SM90 (Hopper)")
            print(f"flashmla not available: {why}\ndeepgemm not available: {why}")
        else:
            if not os.environ.get("CUDA_HOME") and Path("/usr/local/cuda/bin/nvcc").exists():
                os.environ["CUDA_HOME"] = "/usr/local/cuda"  # DeepGEMM's JIT finds nvcc there
            if any(s.startswith("flashmla") for s in sections):
                try:
                    peers["flashmla"] = load_flashmla()
                except Exception as e:
                    print(f"flashmla not available: {type(e).__name__}: {e}")
            if any(s.startswith("deepgemm") for s in sections):
                try:
                    peers["deepgemm"] = load_deepgemm()
                except Exception as e:
                    print(f"deepgemm not available: {type(e).__name__}: {e}")
    if not peers and not torch_sections:
        return 0
    if on_cuda:
        device = torch.cuda.get_device_name(0).replace(" ", "_")
        where = (f"cuda={torch.version.cuda} device={device}"
                 f" sms={torch.cuda.get_device_properties(0).multi_processor_count}")
    else:
        where = f"device={DEVICE} threads={torch.get_num_threads()}"
    for name, loaded in peers.items():
        module = loaded[0]
        print(f"peer {name} info commit={loaded[-1]} module={Path(module.__file__).parent} torch={torch.__version__}"
              f" {where}")
    if torch_sections:
        print(f"peer torch info torch={torch.__version__} {where}")

    bench = Bench(torch)
    with torch.inference_mode():
        # The PyTorch sections first: a library that crashes the process (DeepGEMM's paged logits segfaulted on
        # the H200 in session 3) would otherwise take them with it.
        if "torch_dsa_decode" in torch_sections:
            for L in args.contexts:
                for B in args.batches:
                    bench.torch_dsa_decode(B, L, args.heads, args.index_heads)
                    bench.release()
        if "torch_dense_mla_decode" in torch_sections:
            for L in args.contexts:
                for B in args.batches:
                    bench.torch_dense_mla_decode(B, L, args.heads)
                    bench.release()
        if "deepgemm_paged" in sections and "deepgemm" in peers:
            for L in args.contexts:
                for B in args.batches:
                    bench.deepgemm_paged(peers["deepgemm"][0], B, L, args.index_heads)
                    torch.cuda.empty_cache()
        if "flashmla_decode" in sections and "flashmla" in peers:
            fm, quant, _ = peers["flashmla"]
            for L in args.contexts:
                for B in args.batches:
                    bench.flashmla_decode(fm, quant, B, L, args.heads)
                    torch.cuda.empty_cache()
        if "deepgemm_prefill" in sections and "deepgemm" in peers:
            for L in args.prefill_contexts:
                for S in args.prefill_queries:
                    bench.deepgemm_prefill(peers["deepgemm"][0], S, L, args.index_heads)
        if "flashmla_prefill" in sections and "flashmla" in peers:
            for L in args.prefill_contexts:
                for S in args.prefill_queries:
                    bench.flashmla_prefill(peers["flashmla"][0], S, L, args.heads)
    return 1 if bench.failed else 0

if __name__ == "__main__":
    sys.exit(main())
