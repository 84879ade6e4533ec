"""Golden tests of the tokenizer that `kestrel make-model` writes: a byte-level BPE trained by Kestrel on the King
James Bible, as tokenizer.json and as a tiktoken rank file. Kestrel's ids must equal those of `tokenizers` and
`tiktoken` on the corpus for both files, decoding must round-trip, and the trained vocabulary must be a real BPE.
"""

import json
import shutil
import subprocess

import pytest

from text_harness import check_hf_dir, check_tiktoken_dir, kestrel_bin

tokenizers = pytest.importorskip("tokenizers")
tiktoken = pytest.importorskip("tiktoken")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("made") / "tiny"
    res = subprocess.run([kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(d)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.fail(f"make-model failed:\n{res.stderr}")
    for f in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json"):
        assert (d / f).exists(), (f"make-model wrote no {f}: it must write the trained tokenizer "
                                   "(text::write_trained_tokenizer, see docs/text.md)")
    return d


def test_trained_vocabulary_is_a_real_bpe(model_dir):
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    # The special-token ids make-model's chat format relies on.
    assert specials["[BOS]"] == 256 and specials["<|im_end|>"] == 258 and specials["[PAD]"] == 270
    assert len(merges) >= 1000
    assert max(vocab.values()) < cfg["vocab_size"]
    ref = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # Frequent KJV words are single tokens; text compresses well below one token per byte.
    for w in [" the", " and", " LORD", " God", " said"]:
        assert len(ref.encode(w, add_special_tokens=False).ids) == 1, w
    text = "And God said, Let there be light: and there was light."
    assert len(ref.encode(text).ids) * 3 < len(text)


def test_trained_tokenizer_json_matches_tokenizers(model_dir):
    check_hf_dir(model_dir, "make-model tokenizer.json", round_trips=True)


def test_trained_tiktoken_matches_tiktoken(model_dir, tmp_path):
    d = tmp_path / "tiktoken_only"
    d.mkdir()
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(model_dir / f, d / f)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    ranks = load_tiktoken_bpe(str(d / "tiktoken.model"))
    specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding(name="kestrel_tiny", pat_str=cfg["pat_str"], mergeable_ranks=ranks,
                            special_tokens=specials)
    check_tiktoken_dir(d, enc, set(ranks.values()) | set(specials.values()), set(specials.values()),
                       "make-model tiktoken.model")
