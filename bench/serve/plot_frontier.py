#!/usr/bin/env python3
"""Plots the frontier of a `kestrel bench serve --sweep-concurrency ... --save-result FILE` run: output tokens/s
per user (interactivity, 1000 / mean TPOT) against output tokens/s per device (throughput), one point per
concurrency. Usage: plot_frontier.py RESULT.json [RESULT2.json ...] --out PLOT.png [--title TEXT]"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    data = json.loads(Path(path).read_text())
    points = []
    for r in data["sweep"]:
        points.append((r["output_tokens_per_s_per_user"], r["output_throughput_per_device"], r["max_concurrency"]))
    label = f'{data["sweep"][0]["model_id"]} ({data["sweep"][0]["dataset"]})'
    return label, points


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Throughput vs interactivity")
    a = ap.parse_args()
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    for path in a.results:
        label, pts = load(path)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, c in pts:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tokens/s per user (1000 / mean TPOT)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(a.title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
