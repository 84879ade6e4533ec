#!/usr/bin/env bash
# Tokenizer encoding throughput: Kestrel vs tokenizers vs tiktoken on the same files and texts, single thread.
# Usage: bench/text/run_tokenizer_bench.sh TOKENIZER_BENCH_BINARY [WORK_DIR]
# Needs: the `bible` program (Debian bible-kjv-text), .venv with tokenizers and tiktoken.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$1
WORK=${2:-/tmp/kestrel-tokenizer-bench}
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
bible Gen1:1-Rev22:21 > "$WORK/kjv.txt"
# Mixed text: the golden-test corpus (English, code, CJK, emoji, whitespace runs, digits, other scripts).
$PY -c "import sys, json; sys.path.insert(0, 'tests/python'); import text_corpus
with open('$WORK/corpus.jsonl', 'w') as f:
    [f.write(json.dumps(s) + '\n') for s in text_corpus.strings()]
open('$WORK/corpus.txt', 'w').write('\n'.join(text_corpus.strings()))"
for V in 4096 32000; do
  D=$WORK/bpe$V
  mkdir -p "$D/tiktoken"
  "$BIN" train "$D" "$V"
  cp "$D/tiktoken.model" "$D/tokenizer_config.json" "$D/tiktoken/"
  for T in kjv.txt corpus.txt; do
    echo "== vocab $V, $T as one text"
    "$BIN" encode "$D" "$WORK/$T"
    "$BIN" encode "$D/tiktoken" "$WORK/$T"
    $PY bench/text/reference_bench.py encode "$D" "$WORK/$T"
  done
  echo "== vocab $V, corpus strings one at a time"
  "$BIN" lines "$D" "$WORK/corpus.jsonl"
  "$BIN" lines "$D/tiktoken" "$WORK/corpus.jsonl"
  $PY bench/text/reference_bench.py lines "$D" "$WORK/corpus.jsonl"
done
