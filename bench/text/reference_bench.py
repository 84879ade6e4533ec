"""Encoding throughput of the reference libraries on the same files and texts as bench/text/tokenizer_bench.cpp:
`tokenizers` on MODEL_DIR/tokenizer.json and `tiktoken` on MODEL_DIR/tiktoken.model (+ tokenizer_config.json),
single thread, best of --repeat runs. Modes as there: `encode` (one text) and `lines` (a JSON string per line).

Usage: python bench/text/reference_bench.py {encode,lines} MODEL_DIR FILE [--repeat N]
"""

import argparse
import json
import os
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["encode", "lines"])
    ap.add_argument("model_dir")
    ap.add_argument("file")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tiktoken
    import tokenizers
    from tiktoken.load import load_tiktoken_bpe

    raw = Path(args.file).read_bytes().decode("utf-8")
    texts = [raw] if args.mode == "encode" else [json.loads(line) for line in raw.splitlines() if line]
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    d = Path(args.model_dir)

    def best_of(encode):
        best, n = float("inf"), 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            n = sum(len(encode(s)) for s in texts)
            best = min(best, time.perf_counter() - t)
        return best, n

    if (d / "tokenizer.json").exists():
        tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        t, n = best_of(lambda s: tok.encode(s, add_special_tokens=False).ids)
        print(f"tokenizers {tokenizers.__version__} ({tok.get_vocab_size()} ids) {args.mode}: {nbytes} bytes -> {n} "
              f"tokens, best {t:.4f} s, {nbytes / t / 1e6:.2f} MB/s")
    if (d / "tiktoken.model").exists():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        specials = {v["content"]: int(k) for k, v in cfg.get("added_tokens_decoder", {}).items()}
        enc = tiktoken.Encoding(name="bench", pat_str=cfg["pat_str"],
                                mergeable_ranks=load_tiktoken_bpe(str(d / "tiktoken.model")), special_tokens=specials)
        t, n = best_of(lambda s: enc.encode(s, allowed_special="all"))
        print(f"tiktoken {tiktoken.__version__} ({enc.n_vocab} ids) {args.mode}: {nbytes} bytes -> {n} tokens, "
              f"best {t:.4f} s, {nbytes / t / 1e6:.2f} MB/s")


if __name__ == "__main__":
    main()
