"""Shared helpers of the server tests: tiny checkpoints (a random one, and a "scripted" one whose greedy output is
known), and `kestrel serve` started on a free loopback port and always stopped. No tests live here."""

import json
import os
import re
import signal
import struct
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kestrel_binary import kestrel_bin

REPO = Path(__file__).resolve().parents[2]

# Ids of the tiny models' tokenizer (src/model/tokenizer_files.h): bytes, then the Kimi special tokens.
EOS = 258             # <|im_end|>
IM_MIDDLE = 262       # the last token of a chat prompt with add_generation_prompt
THINK, END_THINK = 263, 264
SECTION_BEGIN, SECTION_END = 265, 266
CALL_BEGIN, ARGS_BEGIN, CALL_END = 267, 268, 269

# Texts of the scripted model, each one added token.
REASONING = "Let me check the weather."
CONTENT = "Checking."
CALL_ID = "functions.get_weather:0"
ARGUMENTS = '{"city": "Paris"}'
# The assistant turn of the scripted model, Kimi markup (ints: special tokens, strings: added tokens).
KIMI_TURN = [THINK, REASONING, END_THINK, CONTENT, SECTION_BEGIN, CALL_BEGIN, CALL_ID, ARGS_BEGIN, ARGUMENTS, CALL_END,
             SECTION_END]
# The same turn with DeepSeek-V3.2's DSML tool call (one added token).
DSML_CALL = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
DSML_TURN = [THINK, REASONING, END_THINK, CONTENT, DSML_CALL]
# A completion prompt "Z" continues with these pieces, then ends (EOS).
COMPLETION_PIECES = ["Hello", " world", ",", " this", " is", " kestrel", "."]
SCRIPTED_COMPLETION = "".join(COMPLETION_PIECES)




def make_tiny(directory) -> Path:
    directory = Path(directory)
    subprocess.run([kestrel_bin(), "make-model", "--arch", "kimi_k3", "--preset", "tiny", "--out", str(directory)],
                   check=True, capture_output=True, timeout=120)
    return directory


def _read_safetensors(path):
    data = Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], data[8 + n + b:8 + n + e])
    return tensors, meta


def _write_safetensors(path, tensors, meta):
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    if meta is not None:
        header["__metadata__"] = meta
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _bf16_to_f32(raw, shape):
    return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape).copy()


def _f32_to_bf16(values: np.ndarray) -> bytes:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x8000) >> 16).astype(np.uint16).tobytes()  # round to nearest (exact for our values)


def make_scripted(directory, turn=KIMI_TURN) -> Path:
    """A tiny kimi_k3 checkpoint whose greedy continuation of a token depends (almost) only on that token, so that
    outputs are known in advance: a huge embedding along one axis per chain token swamps every layer's output, and
    the LM head maps that axis to the next token of the chain. The vocabulary grows by one added (non-special)
    token per text below. Chains:
      chat:        <|im_middle|> TURN <|im_end|>   (KIMI_TURN: <think> REASONING </think> CONTENT <section> <call>
                   CALL_ID <args> ARGUMENTS <call_end> <section_end>)
      completion:  'Z' Hello ' world' ',' ' this' ' is' ' kestrel' '.' <|im_end|>"""
    directory = make_tiny(directory)
    config = json.loads((directory / "config.json").read_text())
    vocab = config["vocab_size"]
    tok_path = directory / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    texts = [t for t in turn if isinstance(t, str)] + COMPLETION_PIECES
    ids = {t: vocab + i for i, t in enumerate(texts)}
    for t, tid in ids.items():
        tok["added_tokens"].append({"id": tid, "content": t, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))
    (directory / "tiktoken.model").unlink(missing_ok=True)  # tokenizer.json is the tokenizer now
    config["vocab_size"] = vocab + len(texts)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    completion_start = tok_ids(directory, "Z")
    chains = [
        [IM_MIDDLE] + [ids[t] if isinstance(t, str) else t for t in turn] + [EOS],
        completion_start[-1:] + [ids[p] for p in COMPLETION_PIECES] + [EOS],
    ]
    tensors, meta = _read_safetensors(directory / "model.safetensors")
    mats = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        dtype, shape, raw = tensors[name]
        assert dtype == "BF16" and shape[0] == vocab
        m = np.zeros((vocab + len(texts), shape[1]), dtype=np.float32)
        m[:vocab] = _bf16_to_f32(raw, shape)
        mats[name] = m
    embed, head = mats["model.embed_tokens.weight"], mats["lm_head.weight"]
    axis = 0
    for chain in chains:
        for cur, nxt in zip(chain, chain[1:]):
            embed[cur] = 0.0
            embed[cur, axis] = 1000.0
            head[:, axis] = 0.0
            head[nxt, axis] = 10.0
            axis += 1
    assert axis <= embed.shape[1]
    for name, m in mats.items():
        tensors[name] = ("BF16", list(m.shape), _f32_to_bf16(m))
    dtype, shape, _ = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = (dtype, shape, _f32_to_bf16(np.ones(shape, dtype=np.float32)))
    _write_safetensors(directory / "model.safetensors", tensors, meta)
    return directory


def tok_ids(model_dir, text):
    """Token ids of `text` under the checkpoint's tokenizer, from the reference `tokenizers` library."""
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


class Server:
    """`kestrel serve MODEL_DIR` on 127.0.0.1 and a free port; stop() sends SIGTERM and checks the exit code."""

    def __init__(self, model_dir, *args, name="tiny"):
        self.name = name
        cmd = [kestrel_bin(), "serve", str(model_dir), "--host", "127.0.0.1", "--port", "0",
               *(["--served-model-name", name] if name else []), *map(str, args)]
        # The client shares the CPU (2 cores in CI): OpenMP barriers of a multi-threaded engine step then wait for
        # time slices, and the tiny models gain nothing from threads.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("KESTREL_SERVER_OMP_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        self.port = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        if not ready.wait(60) or self.port is None:
            self.proc.kill()
            pytest.fail("kestrel serve did not start:\n" + "".join(self.log))

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai
        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def metrics(self):
        """The /metrics samples as {name: value} for unlabelled-but-model samples, {(name, labels...): value}
        otherwise (parsed with prometheus_client)."""
        from prometheus_client.parser import text_string_to_metric_families
        _, text = self.get("/metrics")
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                extra = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name,) + extra if extra else s.name] = s.value
        return out

    def wait_idle(self, timeout=10.0):
        """Waits until nothing runs, waits or is in flight and no cache row is held; returns the metrics."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (m["kestrel:num_requests_running"] == 0 and m["kestrel:num_requests_waiting"] == 0
                    and m["kestrel:num_requests_in_flight"] == 0 and m["kestrel:kv_cache_usage_perc"] == 0):
                return m
            if time.time() > deadline:
                pytest.fail(f"the server did not become idle: {m}")
            time.sleep(0.02)

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail("kestrel serve did not exit after SIGTERM:\n" + "".join(self.log))
        self._drain.join(5)
        return self.proc.returncode


def post(url, body, headers=None, timeout=60):
    """POSTs bytes or a JSON-able body; returns (status, parsed JSON or text)."""
    data = body if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    return make_scripted(tmp_path_factory.mktemp("scripted"))
