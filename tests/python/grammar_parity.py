"""Helpers of the grammar parity tests (test_grammar_parity.py): xgrammar on the CPU without torch, Kestrel's grammar
engine through tests/grammar/grammar_probe, random schemas of every supported feature, and random instances of a
schema written as xgrammar orders them. No tests live here.

xgrammar (PyPI) is installed with --no-deps (tools/run-tests.sh): its wheel requires torch, transformers and triton,
but its matcher and mask filling are C++ reached through tvm_ffi with numpy arrays; torch is imported only for
tensor helpers these tests do not use and transformers only for tokenizer adapters. Stand-ins for those two modules
make `import xgrammar` work; tvm_ffi is imported first so that it sees no torch."""

import json
import os
import random
import string
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kestrel_binary import kestrel_bin


def import_xgrammar():
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        why = "xgrammar is not installed (pip install --no-deps -r tests/python/requirements-grammar.txt)"
        if os.environ.get("KESTREL_REQUIRE_XGRAMMAR"):  # tools/run-tests.sh installs it: missing is a failure
            pytest.fail(why)
        pytest.skip(why)

    class _Absent(types.ModuleType):
        """A module whose every attribute is an empty class: enough for xgrammar's annotations and subclasses."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    for name in ("torch", "transformers"):
        if name not in sys.modules:
            sys.modules[name] = _Absent(name)
    if not hasattr(sys.modules["torch"], "tensor") or isinstance(sys.modules["torch"], _Absent):
        sys.modules["torch"].tensor = lambda *a, **k: None
    import xgrammar
    return xgrammar


def probe_binary():
    path = Path(kestrel_bin()).resolve().parent.parent / "tests" / "grammar_probe"
    if not os.access(path, os.X_OK):
        pytest.skip(f"no grammar_probe at {path} (build the tests)")
    return str(path)


class Probe:
    """Kestrel's engine: one JSON request per line (tests/grammar/grammar_probe.cpp)."""

    def __init__(self, model_dir, vocab_size, stops):
        self.proc = subprocess.Popen([probe_binary(), str(model_dir), str(vocab_size)] + [str(s) for s in stops],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "grammar_probe exited"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def mask_int(hex_words):
    return int.from_bytes(bytes.fromhex(hex_words), "little")


class Reference:
    """xgrammar over the same vocabulary: ordinary tokens by their bytes, special tokens empty (never allowed, as
    Kestrel's grammars never allow a special token they do not name), the same stop token."""

    def __init__(self, xgr, vocab):
        import numpy as np
        self.np = np
        self.xgr = xgr
        self.V = vocab["vocab_size"]
        tokens = [bytes.fromhex(h) if k == 1 else b"" for h, k in zip(vocab["tokens"], vocab["kinds"])]
        self.tokens = tokens
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=self.V, stop_token_ids=vocab["stop"])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind, spec, any_whitespace=True):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=any_whitespace)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "grammar":
            return self.compiler.compile_grammar(spec)
        raise ValueError(kind)

    def masks(self, compiled, tokens):
        """The allowed set (as an int bitmask) before each token and after the last; stops early (returning the
        index) when xgrammar refuses a token."""
        m = self.xgr.GrammarMatcher(compiled)
        buf = self.np.zeros((1, (self.V + 31) // 32), dtype=self.np.int32)
        out = []
        for i in range(len(tokens) + 1):
            if m.is_terminated():
                out.append(0)
            else:
                buf[:] = 0
                m.fill_next_token_bitmask(buf)
                out.append(int.from_bytes(buf.tobytes(), "little") & ((1 << self.V) - 1))
            if i < len(tokens) and not m.accept_token(tokens[i]):
                return out, i
        return out, None


# ---------------------------------------------------------------- random schemas

WORDS = ["id", "name", "age", "email", "tags", "items", "price", "count", "active", "city", "zip", "note", "kind",
         "value", "start", "end", "level", "owner", "size", "color", "a", "b", "x", "é", "key with space", ""]


def _name(rng, used):
    for _ in range(20):
        w = rng.choice(WORDS)
        if w not in used:
            used.add(w)
            return w
    w = "k" + str(len(used))
    used.add(w)
    return w


def random_leaf(rng):
    """A schema without sub-schemas, of one of the features."""
    kind = rng.randrange(17)
    if kind == 0:
        return {"type": "string"}
    if kind == 1:
        return {"type": "integer"}
    if kind == 2:
        return {"type": "number"}
    if kind == 3:
        return {"type": "boolean"}
    if kind == 4:
        return {"type": "null"}
    if kind == 5:
        lo = rng.randrange(-1000, 1000)
        s = {"type": "integer", "minimum": lo}
        if rng.random() < 0.7:
            s["maximum"] = lo + rng.choice([0, 1, 9, 10, 99, 12345])
        return s
    if kind == 6:
        s = {"type": "integer"}
        lo = rng.choice([-(2 ** 63), -5, 0, 7, 2 ** 40])
        s[rng.choice(["exclusiveMinimum", "minimum"])] = lo
        if rng.random() < 0.5:
            s[rng.choice(["exclusiveMaximum", "maximum"])] = rng.choice([v for v in (2 ** 63 - 1, 9, 100, 2 ** 41)
                                                                          if v > lo + 1])
        return s
    if kind == 7:
        lo = rng.choice([-10, -1, -0.5, 0, 0.25, 1.5, 3])
        s = {"type": "number", rng.choice(["minimum", "exclusiveMinimum"]): lo}
        if rng.random() < 0.6:
            s[rng.choice(["maximum", "exclusiveMaximum"])] = lo + rng.choice([0.5, 1, 2.75, 10, 1000])
        return s
    if kind == 8:
        return {"enum": rng.sample(["red", "green", "blue", "a\"b", "ünï", 1, 2, -3, True, None, [1, 2], {"k": "v"}],
                                   rng.randrange(1, 5))}
    if kind == 9:
        return {"const": rng.choice(["fixed", 42, False, None, {"a": [1, {"b": None}]}])}
    if kind == 10:
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,4}$", r"\d{3}-\d{4}", r"(ab|cd)+x?", r"[A-Z][a-z]*",
                                                         r"^\w+@\w+\.com$", r"[^,]{1,3}", r"é+|ü"])}
    if kind == 11:
        return {"type": rng.sample(["string", "integer", "number", "boolean", "null", "array", "object"],
                                   rng.randrange(2, 4))}
    if kind == 12:
        return {"type": "object"}
    if kind == 13:
        return {"type": "array"}
    if kind == 14:
        return {}
    if kind == 15:
        lo = rng.randrange(0, 4)
        s = {"type": "string", "minLength": lo}
        if rng.random() < 0.8:
            s["maxLength"] = lo + rng.randrange(0, 6)
        return s
    return {"type": "string", "description": "annotated", "title": "T", "examples": ["x"], "default": "d"}


# xgrammar reads a schema that is only {"type": "array"} or {"type": "object"} as the empty array / object when it
# is reached through allOf or $ref (and as any array / object elsewhere); Kestrel reads it as any array / object
# everywhere. Such schemas are kept out of allOf and $defs here.
BARE = ({"type": "array"}, {"type": "object"})


def _not_bare(rng, make):
    for _ in range(50):
        s = make()
        if s not in BARE:
            return s
    return {"type": "integer"}


def random_schema(rng, depth=0, defs=None):
    if depth >= 3 or rng.random() < 0.3:
        return random_leaf(rng)
    kind = rng.randrange(7)
    if kind <= 2:
        used = set()
        props = {_name(rng, used): random_schema(rng, depth + 1, defs) for _ in range(rng.randrange(0, 5))}
        s = {"type": "object", "properties": props}
        if props:
            s["required"] = [k for k in props if rng.random() < 0.5]
        r = rng.random()
        if r < 0.2:
            s["additionalProperties"] = True
        elif r < 0.35:
            s["additionalProperties"] = random_leaf(rng)
        elif r < 0.5:
            s["additionalProperties"] = False
        if rng.random() < 0.1:
            del s["type"]  # the type follows from 'properties'
        return s
    if kind == 3:
        s = {"type": "array"}
        if rng.random() < 0.4:
            s["prefixItems"] = [random_schema(rng, depth + 1, defs) for _ in range(rng.randrange(1, 3))]
            r = rng.random()
            if r < 0.4:
                s["items"] = False
            elif r < 0.7:
                s["items"] = random_schema(rng, depth + 1, defs)
        else:
            s["items"] = random_schema(rng, depth + 1, defs)
        if rng.random() < 0.5:
            s["minItems"] = rng.randrange(0, 3 if s.get("items") is not False else len(s["prefixItems"]) + 1)
        if rng.random() < 0.5:  # xgrammar refuses maxItems below the prefixItems' count
            s["maxItems"] = max(s.get("minItems", 0), len(s.get("prefixItems", []))) + rng.randrange(0, 4)
        return s
    if kind == 4:
        return {rng.choice(["anyOf", "oneOf"]): [random_schema(rng, depth + 1, defs) for _ in range(rng.randrange(1, 4))]}
    if kind == 5 and defs is not None:
        name = f"d{len(defs)}"
        defs[name] = None
        defs[name] = _not_bare(rng, lambda: random_schema(rng, depth + 1, defs))
        return {"$ref": f"#/$defs/{name}"}
    return {"allOf": [_not_bare(rng, lambda: random_schema(rng, depth + 1, defs))],
            "description": "one schema, annotated"}


def schema_corpus(n, seed):
    """`n` random schemas plus hand-written real-world ones: nested objects, optional and required properties,
    additional properties, tuples, bounded arrays, unions, $defs (recursive too), patterns, ranges."""
    rng = random.Random(seed)
    out = list(REAL_WORLD)
    while len(out) < n:
        defs = {}
        s = random_schema(rng, 0, defs)
        if defs:
            s = {**s, "$defs": defs} if isinstance(s, dict) and "$ref" not in s else {"allOf": [s], "$defs": defs}
        out.append(s)
    return out


ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                            "zip": {"type": "string", "pattern": r"\d{5}"},
                                            "country": {"enum": ["FR", "DE", "US"]}},
           "required": ["street", "city"]}
REAL_WORLD = [
    {"title": "User", "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "name": {"type": "string"},
        "email": {"type": "string", "pattern": r"^[a-z0-9.]+@[a-z]+\.[a-z]{2,3}$"},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}], "default": None},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "minItems": 1},
        "address": ADDRESS}, "required": ["id", "name", "roles"]},
    {"$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"},
                                                          "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                                          "price": {"type": "number", "minimum": 0}},
                        "required": ["sku", "qty"]}},
     "type": "object", "properties": {"order_id": {"type": "string"},
                                      "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                      "shipping": {"allOf": [{"$ref": "#/$defs/Address"}]},
                                      "status": {"const": "open"}},
     "required": ["order_id", "items"], "definitions": {}},
    {"$defs": {"Node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                          "children": {"type": "array",
                                                                       "items": {"$ref": "#/$defs/Node"}}},
                        "required": ["value"]}}, "$ref": "#/$defs/Node"},
    {"type": "object", "properties": {"location": {"type": "string", "description": "City"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
     "required": ["location"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False, "minItems": 2},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"": {"type": "string"}, "k": {"type": "boolean"}}, "required": [""]},
    {"type": "object", "properties": {"event": {"type": "string"}, "when": {"type": "object", "properties": {
        "start": {"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807},
        "tz": {"type": ["string", "null"]}}}}, "required": ["event", "when"]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"]},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                "required": ["kind", "side"]}]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {
        "type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 2}, "maxItems": 3}}},
]
REAL_WORLD[1]["$defs"]["Address"] = ADDRESS


# ---------------------------------------------------------------- random instances


def _resolve(schema, root):
    while isinstance(schema, dict) and "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            if part:
                node = node[part.replace("~1", "/").replace("~0", "~")]
        schema = node
    return schema


def _string_for(rng, schema):
    if "pattern" in schema:
        return None  # generating from a regex is not done here: random walks cover patterns
    if "format" in schema:
        return None
    n = rng.randrange(schema.get("minLength", 0), min(schema.get("maxLength", 6), schema.get("minLength", 0) + 6) + 1)
    return "".join(rng.choice(string.ascii_letters + " é\"\\/") for _ in range(n))


def instance(rng, schema, root, depth=0):
    """A random value valid under `schema` as xgrammar reads it, or None when this generator cannot make one (then
    the random walks alone test the schema). Object keys come in schema order, additional ones last."""
    schema = _resolve(schema, root)
    if schema is True or schema == {} or depth > 6:
        return {"v": rng.choice([1, "s", None, True, [1], {"a": 2}])} if depth <= 6 else 0
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng, rng.choice(schema[key]), root, depth + 1)
    if "allOf" in schema:
        return instance(rng, schema["allOf"][0], root, depth + 1)
    # enum and const values are matched as their compact text: an object or array among them would have to be
    # written without whitespace, which dumps() does not do.
    if "const" in schema:
        return None if isinstance(schema["const"], (dict, list)) else {"v": schema["const"]}
    if "enum" in schema:
        v = rng.choice(schema["enum"])
        return None if isinstance(v, (dict, list)) else {"v": v}
    types_ = schema.get("type")
    if types_ is None:
        types_ = "object" if "properties" in schema else "array" if "items" in schema else None
    if types_ is None:
        return {"v": rng.choice([1, "s", None, {"a": [True]}])}
    t = rng.choice(types_) if isinstance(types_, list) else types_
    if t == "null":
        return {"v": None}
    if t == "boolean":
        return {"v": rng.random() < 0.5}
    if t == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -50) + (1 if "exclusiveMinimum" in schema else 0))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", lo + 100) - (1 if "exclusiveMaximum" in schema else 0))
        lo, hi = int(-(-lo // 1)), int(hi // 1)
        return {"v": rng.randint(lo, hi)} if lo <= hi else None
    if t == "number":
        if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return None  # bounded numbers have xgrammar's 6-digit form: walks cover them
        return {"v": rng.choice([0, -1.5, 3.25, 1e3, 12])}
    if t == "string":
        s = _string_for(rng, schema)
        return None if s is None else {"v": s}
    if t == "array":
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True if not prefix else None)
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + 3)
        if items is False or items is None:
            hi = min(hi, len(prefix))
        if lo > hi:
            return None
        n = rng.randint(lo, hi)
        out = []
        for i in range(n):
            sub = prefix[i] if i < len(prefix) else (items if items not in (None, False) else True)
            v = instance(rng, sub, root, depth + 1)
            if v is None:
                return None
            out.append(v["v"])
        return {"v": out}
    if t == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and extra is None and "required" not in schema:
            return {"v": {"any": 1}}
        props = props or {}
        out = {}
        req = set(schema.get("required", []))
        for k, sub in props.items():
            if k in req or rng.random() < 0.5:
                v = instance(rng, sub, root, depth + 1)
                if v is None:
                    return None
                out[k] = v["v"]
        if extra not in (None, False) and rng.random() < 0.5:
            v = instance(rng, extra, root, depth + 1)
            if v is None:
                return None
            key = "zz_extra"
            if key not in props:
                out[key] = v["v"]
        return {"v": out}
    return None


def dumps(rng, value, any_whitespace=True):
    """JSON text of `value`: compact (", ", ": ") without any_whitespace, else with random whitespace."""
    if not any_whitespace:
        return json.dumps(value, ensure_ascii=False)
    return rng.choice([json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2),
                       json.dumps(value, ensure_ascii=False, separators=(",", ":"))])
