"""Shared helpers of the text golden tests: locating `kestrel tokenize`, running its JSON-lines batch mode, and
building tokenizer files with the reference libraries."""

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kestrel_bin() -> str:
    path = os.environ.get("KESTREL_BIN")
    if path:
        if not os.access(path, os.X_OK):
            pytest.fail(f"KESTREL_BIN={path} is not an executable")
        return path
    default = REPO / "build" / "src" / "kestrel"
    if not os.access(default, os.X_OK):
        pytest.skip(f"no kestrel binary at {default} (build it or set KESTREL_BIN)")
    return str(default)


def batch(model_dir, requests, extra_args=()):
    """Sends JSON requests to `kestrel tokenize MODEL_DIR --jsonl`; returns one reply dict per request."""
    payload = "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in requests)
    cmd = [kestrel_bin(), "tokenize", str(model_dir), "--jsonl", *extra_args]
    res = subprocess.run(cmd, input=payload.encode(), capture_output=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr.decode(errors='replace')}")
    lines = res.stdout.decode().split("\n")[:-1]
    assert len(lines) == len(requests), f"{len(requests)} requests, {len(lines)} replies"
    return [json.loads(line) for line in lines]


def write_tiktoken_files(directory, ranks, specials, pat_str=None):
    """ranks: dict bytes -> rank; specials: dict str -> id. Writes tiktoken.model and tokenizer_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "tiktoken.model", "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    cfg = {"added_tokens_decoder": {str(i): {"content": s, "special": True} for s, i in specials.items()}}
    if pat_str is not None:
        cfg["pat_str"] = pat_str
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))


def report(mismatches, what):
    if mismatches:
        head = "\n".join(repr(m)[:400] for m in mismatches[:8])
        pytest.fail(f"{len(mismatches)} {what} mismatches; first ones:\n{head}")
