"""A peer of bench/gpu/sampling_bench.cpp on the same GPU: sort-based top-k / top-p sampling in PyTorch, the method
of the PyTorch fallback samplers in vLLM and SGLang (FlashInfer's sorting-free kernels are not on the device).

Per step: logits / T, optional top-k (the k-th largest as a threshold), a full descending sort, softmax, cumulative
sum, the top-p cut, then one draw per row with torch.multinomial. The same shapes and logits distribution as
sampling_bench (N(0, 5^2)); median of 20 steps after 3 warm-ups, each timed alone with CUDA events (direct
launches; the number includes Python and launch time the GPU waits for), and the median of 20 CUDA-graph replays of
one captured step. Prints one line per case in sampling_bench's order.
Usage: python3 bench/gpu/peer_sampling_torch.py [--iters N]"""

import argparse
import statistics

import torch


def step(logits, temperature, top_k, top_p):
    x = logits / temperature
    if top_k > 0:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    probs = probs.masked_fill(cum - probs > top_p, 0.0)
    pick = torch.multinomial(probs, 1)
    return idx.gather(-1, pick)


def time_direct(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def time_graph(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"peer_sampling_torch: torch {torch.__version__}, logits N(0, 5.00^2), median of {args.iters} runs; "
          "us per step (direct | graph replay)")
    cases = [("top-p 0.95, T 1", 1.0, 0, 0.95), ("top-k 50 + top-p 0.95, T 0.7", 0.7, 50, 0.95),
             ("top-p 1, T 1", 1.0, 0, 1.0)]
    for V in (163840, 129280):
        for name, t, k, p in cases:
            for B in (1, 8, 32, 64, 256):
                logits = torch.randn(B, V, device="cuda") * 5.0
                fn = lambda: step(logits, t, k, p)  # noqa: E731
                d = time_direct(fn, args.iters)
                try:
                    g = f"{time_graph(fn, args.iters):8.1f}"
                except RuntimeError as e:  # capture not possible: say why, keep the direct number
                    g = f"graph n/a ({str(e).splitlines()[0][:60]})"
                print(f"V={V} B={B:<3} {name:<30} torch {d:8.1f} | {g}", flush=True)


if __name__ == "__main__":
    main()
