"""Shared helpers of the text golden tests: locating `kestrel tokenize`, running its JSON-lines batch mode, and
building tokenizer files with the reference libraries."""

import base64
import json
import random
import subprocess
from pathlib import Path

import pytest

from kestrel_binary import kestrel_bin

import text_corpus

STREAM_MAX_TOKENS = 200  # streaming is checked at every prefix of the first 200 tokens of each string

REPO = Path(__file__).resolve().parents[2]




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


def _random_ids(r, n_ids, count):
    return [[r.randrange(n_ids) for _ in range(r.randint(1, 12))] for _ in range(count)]


def check_hf_dir(d, name, round_trips):
    """Kestrel vs `tokenizers` on DIR/tokenizer.json: encode (3 modes), decode, skip-special decode, streaming."""
    import tokenizers
    ref = tokenizers.Tokenizer.from_file(str(Path(d) / "tokenizer.json"))
    corpus = text_corpus.strings()
    reqs = []
    for s in corpus:
        reqs.append({"op": "encode", "text": s, "parse_special": True})
        reqs.append({"op": "encode", "text": s, "parse_special": False})
        reqs.append({"op": "encode", "text": s, "parse_special": True, "add_special_tokens": True})
    got = batch(d, reqs)
    mism = []
    ids_by_string = []
    for i, s in enumerate(corpus):
        g = got[3 * i:3 * i + 3]
        ref.encode_special_tokens = False
        want = ref.encode(s, add_special_tokens=False).ids
        want_post = ref.encode(s, add_special_tokens=True).ids
        ref.encode_special_tokens = True
        want_ordinary = ref.encode(s, add_special_tokens=False).ids
        if g[0].get("ids") != want:
            mism.append((s, "special", g[0], want))
        if g[1].get("ids") != want_ordinary:
            mism.append((s, "ordinary", g[1], want_ordinary))
        if g[2].get("ids") != want_post:
            mism.append((s, "post", g[2], want_post))
        ids_by_string.append(want)
    report(mism, f"{name}: encode")

    r = random.Random(11)
    id_lists = ids_by_string + _random_ids(r, ref.get_vocab_size(), 500)
    reqs = []
    for ids in id_lists:
        reqs.append({"op": "decode", "ids": ids})
        reqs.append({"op": "decode", "ids": ids, "skip_special": True})
        reqs.append({"op": "stream", "ids": ids[:STREAM_MAX_TOKENS]})
    got = batch(d, reqs)
    mism = []
    for i, ids in enumerate(id_lists):
        g = got[3 * i:3 * i + 3]
        want = ref.decode(ids, skip_special_tokens=False)
        if g[0].get("text") != want:
            mism.append((ids, "decode", g[0], want))
        want_skip = ref.decode(ids, skip_special_tokens=True)
        if g[1].get("text") != want_skip:
            mism.append((ids, "decode skip", g[1], want_skip))
        _check_stream(ids[:STREAM_MAX_TOKENS], g[2], lambda p: ref.decode(p, skip_special_tokens=False), mism)
        if round_trips and i < len(corpus) and want != corpus[i]:
            mism.append((ids, "round trip", want, corpus[i]))
    report(mism, f"{name}: decode/stream")


def _check_stream(ids, reply, decode, mism):
    if "chunks" not in reply:
        mism.append((ids, "stream", reply))
        return
    emitted = ""
    for k in range(len(ids)):
        emitted += reply["chunks"][k]
        full = decode(ids[:k + 1])
        if emitted + reply["pending"][k] != full:
            mism.append((ids, f"stream prefix {k + 1}", emitted, reply["pending"][k], full))
            return


def check_tiktoken_dir(d, enc, all_ids, special_ids, name, round_trips=True):
    """Kestrel vs a tiktoken Encoding on DIR/tiktoken.model: encode (2 modes), decode, streaming."""
    corpus = text_corpus.strings()
    reqs = []
    for s in corpus:
        reqs.append({"op": "encode", "text": s, "parse_special": True})
        reqs.append({"op": "encode", "text": s, "parse_special": False})
    got = batch(d, reqs)
    mism = []
    id_lists = []
    for i, s in enumerate(corpus):
        want = enc.encode(s, allowed_special="all")
        want_ordinary = enc.encode_ordinary(s)
        if got[2 * i].get("ids") != want:
            mism.append((s, "special", got[2 * i], want))
        if got[2 * i + 1].get("ids") != want_ordinary:
            mism.append((s, "ordinary", got[2 * i + 1], want_ordinary))
        id_lists.append(want)
    report(mism, f"{name}: encode")

    r = random.Random(12)
    all_ids = sorted(all_ids)
    id_lists += [[r.choice(all_ids) for _ in range(r.randint(1, 12))] for _ in range(500)]
    reqs = []
    for ids in id_lists:
        reqs.append({"op": "decode", "ids": ids})
        reqs.append({"op": "decode", "ids": ids, "skip_special": True})
        reqs.append({"op": "stream", "ids": ids[:STREAM_MAX_TOKENS]})
    got = batch(d, reqs)
    mism = []
    for i, ids in enumerate(id_lists):
        want = enc.decode(ids)
        if got[3 * i].get("text") != want:
            mism.append((ids, "decode", got[3 * i], want))
        want_skip = enc.decode([t for t in ids if t not in special_ids])
        if got[3 * i + 1].get("text") != want_skip:
            mism.append((ids, "decode skip", got[3 * i + 1], want_skip))
        _check_stream(ids[:STREAM_MAX_TOKENS], got[3 * i + 2], enc.decode, mism)
        if round_trips and i < len(corpus) and want != corpus[i]:
            mism.append((ids, "round trip", want, corpus[i]))
    report(mism, f"{name}: decode/stream")
