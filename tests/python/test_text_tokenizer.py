"""Golden tests of Kestrel's tokenizers against the Python `tokenizers` (tokenizer.json) and `tiktoken` (rank file)
libraries, on the deterministic corpus of text_corpus.py, through `kestrel tokenize MODEL_DIR --jsonl`.

Checked for every corpus string and every tokenizer variant: ids with and without special-token parsing and with
the post-processor; decoding of those ids and of random id sequences (which produce invalid UTF-8) with and
without skipping special tokens; the incremental detokenizer equals the full decode at every prefix; invalid
UTF-8 input is rejected with a clear error.
"""

import copy
import json

import pytest

import text_corpus
from text_harness import batch, check_hf_dir, check_tiktoken_dir, report, write_tiktoken_files

tokenizers = pytest.importorskip("tokenizers")
tiktoken = pytest.importorskip("tiktoken")

DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
CL100K_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

def _deepseek_pre_tokenizer():
    return {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in DEEPSEEK_SPLITS),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.fixture(scope="module")
def base_tokenizer_json():
    """A byte-level BPE trained by `tokenizers` itself on the training text, DeepSeek-V3 pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=text_corpus.SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text_corpus.training_text(), trainer=trainer)
    j = json.loads(tok.to_str())
    j["pre_tokenizer"] = _deepseek_pre_tokenizer()
    return j


def _variants(base):
    """tokenizer.json variants that exercise the supported pipeline pieces."""
    out = {}
    out["deepseek"] = copy.deepcopy(base)
    v = copy.deepcopy(base)
    bos = base["added_tokens"][0]
    v["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]],
                                                               "tokens": [bos["content"]]}}}
    out["deepseek_bos"] = v
    v = copy.deepcopy(base)
    v["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    out["gpt2_prefix_space"] = v
    v = copy.deepcopy(base)
    v["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"Regex": r"\p{P}"}, "behavior": "MergedWithPrevious", "invert": False},
        {"type": "Split", "pattern": {"Regex": r"[\p{Han}\p{Hiragana}]"}, "behavior": "Contiguous", "invert": False},
        {"type": "Split", "pattern": {"Regex": r"\n"}, "behavior": "Removed", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    out["behaviors"] = v
    v = copy.deepcopy(base)
    v["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Isolated", "invert": True},
        {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    v["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "\t"}, "content": "    "},
        {"type": "Replace", "pattern": {"Regex": r"\d{4,}"}, "content": "#"},
        {"type": "Strip", "strip_left": False, "strip_right": True},
        {"type": "Prepend", "prepend": "▁"}]}
    for t in v["added_tokens"]:
        if t["content"] in ("<think>", "</think>"):  # matched after normalization
            t["normalized"] = True
    out["normalized"] = v
    v = copy.deepcopy(base)
    v["model"]["ignore_merges"] = True
    for t in v["added_tokens"]:
        if t["content"] in ("<think>", "</think>"):
            t["special"] = False
            t["normalized"] = True
        if t["content"] == "<|im_end|>":
            t["lstrip"] = True
            t["rstrip"] = True
    out["ignore_merges_added"] = v
    return out


@pytest.mark.parametrize("variant", ["deepseek", "deepseek_bos", "gpt2_prefix_space", "behaviors", "normalized",
                                     "ignore_merges_added"])
def test_tokenizer_json_matches_tokenizers(variant, base_tokenizer_json, tmp_path_factory):
    # Variants that add a prefix space, normalize, drop text or strip around added tokens do not round-trip.
    d = tmp_path_factory.mktemp(variant)
    (d / "tokenizer.json").write_text(json.dumps(_variants(base_tokenizer_json)[variant], ensure_ascii=False))
    check_hf_dir(d, variant, round_trips=variant in ("deepseek", "deepseek_bos"))


def _ranks_from_hf(tj):
    """tiktoken ranks from a byte-level vocabulary: rank = id, bytes through the byte alphabet."""
    from tokenizers import pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    char_to_byte = {chr(c): b for b, c in zip(bs, cs)}
    assert set(char_to_byte) == set(alphabet)
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    ranks = {}
    for tok, i in tj["model"]["vocab"].items():
        if tok in specials:
            continue
        ranks[bytes(char_to_byte[c] for c in tok)] = i
    return ranks, specials


@pytest.mark.parametrize("pattern_name", ["kimi_default", "cl100k", "gpt2"])
def test_tiktoken_matches_tiktoken(pattern_name, base_tokenizer_json, tmp_path_factory):
    ranks, specials = _ranks_from_hf(base_tokenizer_json)
    pat = {"kimi_default": KIMI_PATTERN, "cl100k": CL100K_PATTERN, "gpt2": GPT2_PATTERN}[pattern_name]
    d = tmp_path_factory.mktemp("tiktoken_" + pattern_name)
    write_tiktoken_files(d, ranks, specials, None if pattern_name == "kimi_default" else pat)
    enc = tiktoken.Encoding(name="golden", pat_str=pat, mergeable_ranks=ranks, special_tokens=specials)
    check_tiktoken_dir(d, enc, set(ranks.values()) | set(specials.values()), set(specials.values()),
                       f"tiktoken {pattern_name}")


def test_invalid_utf8_is_rejected(base_tokenizer_json, tmp_path_factory):
    d = tmp_path_factory.mktemp("invalid")
    (d / "tokenizer.json").write_text(json.dumps(base_tokenizer_json, ensure_ascii=False))
    bad = text_corpus.invalid_utf8()
    got = batch(d, [{"op": "encode", "hex": b.hex()} for b in bad])
    mism = [(b, g) for b, g in zip(bad, got) if "not valid UTF-8" not in g.get("error", "")]
    report(mism, "invalid UTF-8 not rejected")


def test_tokenize_cli_prints_ids_and_pieces(base_tokenizer_json, tmp_path):
    import subprocess
    from text_harness import kestrel_bin
    (tmp_path / "tokenizer.json").write_text(json.dumps(base_tokenizer_json, ensure_ascii=False))
    ref = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello <|im_end|> 中文\n"
    res = subprocess.run([kestrel_bin(), "tokenize", str(tmp_path), "--text", text], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    want = ref.encode(text, add_special_tokens=False).ids
    assert lines[0] == "ids: [" + ", ".join(map(str, want)) + "]"
    rows = lines[1:1 + len(want)]
    assert [int(r.split()[0]) for r in rows] == want
    special_id = ref.token_to_id("<|im_end|>")
    assert any(r.split()[0] == str(special_id) and '"<|im_end|>"' in r and "(special)" in r for r in rows)
    assert lines[1 + len(want)] == f"{len(want)} tokens, {len(text.encode())} bytes"
    bad = subprocess.run([kestrel_bin(), "tokenize", str(tmp_path / "missing"), "--text", "x"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "neither tokenizer.json nor tiktoken.model" in bad.stderr
