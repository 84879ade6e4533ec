"""xgrammar (PyPI, CPU) on grammar_mask_bench's vocabulary and walks: compile time per workload (compile_json_schema /
compile_regex, cache off) and fill_next_token_bitmask time per step along the same tokens (the bench's 64 rows,
masks filled one row at a time like the C++ bench; B=1 is the first row).

    grammar_mask_bench bench/grammar/workloads.json --dump DIR
    python bench/grammar/xgrammar_compare.py bench/grammar/workloads.json DIR

Needs xgrammar and apache-tvm-ffi (pip install --no-deps -r tests/python/requirements-grammar.txt) and numpy."""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
import numpy as np  # noqa: E402

import grammar_parity  # noqa: E402


def main():
    workloads = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    lines = (out / "vocab.txt").read_text().splitlines()
    tokens = [bytes.fromhex(l[2:]) if l[0] == "b" else b"" for l in lines]
    eos = len(tokens) - 1
    walks = {w["name"]: w["tokens"] for w in json.loads((out / "walks.json").read_text())}
    xgr = grammar_parity.import_xgrammar()
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    print("| workload | compile ms | B=1 step us mean / p50 / p99 | B=64 step us mean (per row) |")
    print("|---|---|---|---|")
    for w in workloads:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        if w["kind"] == "json_schema":
            g = compiler.compile_json_schema(json.dumps(w["spec"]))
        elif w["kind"] == "json_object":
            g = compiler.compile_json_schema('{"type": "object"}')
        else:
            g = compiler.compile_regex(w["spec"])
        compile_ms = (time.perf_counter() - t0) * 1000
        rows = walks[w["name"]]
        buf = np.zeros((1, (len(tokens) + 31) // 32), dtype=np.int32)
        matchers = [xgr.GrammarMatcher(g) for _ in rows]
        steps = max(len(r) for r in rows)
        per_step, first_row = [], []
        for s in range(steps):
            total = 0.0
            for i, (m, r) in enumerate(zip(matchers, rows)):
                if s >= len(r) or m.is_terminated():
                    continue
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(buf)
                dt = (time.perf_counter() - t0) * 1e6
                total += dt
                if i == 0:
                    first_row.append(dt)
                m.accept_token(r[s])
            per_step.append(total)
        q = sorted(first_row)
        print(f"| {w['name']} | {compile_ms:.1f} | {statistics.mean(q):.1f} / {q[len(q) // 2]:.1f} / "
              f"{q[min(len(q) - 1, len(q) * 99 // 100)]:.1f} | {statistics.mean(per_step):.0f} "
              f"({statistics.mean(per_step) / len(rows):.1f}) |")


if __name__ == "__main__":
    main()
