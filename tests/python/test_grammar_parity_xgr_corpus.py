"""Kestrel's grammar engine against xgrammar on xgrammar's OWN test inputs: the JSON schemas, EBNF grammars and regexes
written in the test files of xgrammar's source distribution (the version pinned in requirements-grammar.txt),
downloaded and read at test time by xgrammar_corpus.py; nothing of xgrammar's is kept in this repository.

Every collected case goes through both engines on the tiny models' tokenizer (4096 tokens, as in
test_grammar_parity.py):
- a grammar either engine refuses to compile is counted as skipped, by reason (xgrammar refuses it; Kestrel refuses
  it with an error naming what it does not support; both refuse it); Kestrel must never crash on one;
- otherwise random walks over the allowed tokens (fixed seeds): the allowed-token sets must be identical at every
  step; a walk of a JSON schema that ends must validate with jsonschema; at one step of each walk a token outside
  the mask (an invalid-by-construction continuation) must be refused by both engines;
- the strings xgrammar's tests check against the grammar (instances, with xgrammar's expected verdict) are replayed
  token by token on both: the masks must be identical up to the first refused token, both must refuse the same
  token or both accept the whole string, and a JSON instance jsonschema rejects must be refused by both.

A difference is either one Kestrel makes on purpose (docs/structured-output.md: string length bounds with escapes,
formats as Kestrel's RFC regexes, ...), recognised from the schema, or a pinned known gap (KNOWN_GAPS: exact case
ids, with the reason). A known gap that disappears fails the test, so does any other difference.

With KESTREL_REQUIRE_XGRAMMAR=1 (tools/run-tests.sh) a missing xgrammar or a failed download is a failure, not a skip.
Set KESTREL_XGRAMMAR_SDIST to a downloaded xgrammar-VERSION.tar.gz to skip the download."""

import json
import os
import random
import re
import time
from collections import Counter

import jsonschema
import pytest

import grammar_parity as gp
import test_server_harness as h
import xgrammar_corpus as xc
from test_grammar_parity import as_anyof, deviation_ok, show
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

VOCAB_SIZE, EOS = 4096, h.EOS
WALKS, STEPS = 2, 32

LOOKAHEAD = ("EBNF lookahead assertion '(= ...)' not implied by what follows the rule: xgrammar's mask cache checks a "
             "token that runs past the rule's end against the assertion, so its mask leaves out tokens of the "
             "language and lets in tokens its own matcher then refuses; Kestrel's masks are the language's (the "
             "assertion does not change it, as in xgrammar's matcher)")
FORMAT = "format: Kestrel's RFC regexes, not xgrammar's"
PATTERN_LENGTH = ("'pattern' with 'minLength'/'maxLength': Kestrel restricts the pattern to the length bound, "
                  "xgrammar ignores the bound (Kestrel's mask is the smaller one; docs/structured-output.md)")
LENGTH = "string length bounds: JSON escapes, no raw control characters"
ENUM_TYPE = "enum/const values not of the schema's type are left out"
# Cases where Kestrel differs on purpose (docs/structured-output.md), each recognised from the schema by
# documented_difference(): id -> that reason.
ON_PURPOSE = {
    "json_schema-3294bf028a": ENUM_TYPE,  # test_json_schema_converter.py:3503
    "json_schema-0c6f0aedc5": FORMAT,  # test_json_schema_converter.py:2338
    "json_schema-167efa220a": FORMAT,  # test_function_calling_converter.py:3007
    "json_schema-3d2a4c5d69": FORMAT,  # test_function_calling_converter.py:3486
    "json_schema-3d595719d5": FORMAT,  # test_dynamic_compilation.py:964
    "json_schema-86236b6941": FORMAT,  # test_json_schema_converter.py:2413
    "json_schema-9019f7273a": FORMAT,  # test_json_schema_converter.py:2390
    "json_schema-91ca1a57f2": FORMAT,  # test_json_schema_converter.py:2570
    "json_schema-f1dfd8b8f8": FORMAT,  # test_function_calling_converter.py:3040
    "json_schema-24fd5e380d": PATTERN_LENGTH,  # test_json_schema_converter.py:2833
    "json_schema-63e28edcf6": PATTERN_LENGTH,  # test_json_schema_converter.py:2872
    "json_schema-75b408aca9": PATTERN_LENGTH,  # test_json_schema_converter.py:2863
    "json_schema-be4ed39f53": LENGTH,  # test_grammar_matcher_bounded_string.py:224
    "json_schema-bfad137640": LENGTH,  # test_grammar_matcher_bounded_string.py:224
}
# Cases whose masks differ for a reason Kestrel does not fix (yet): id -> reason. Each must still differ.
KNOWN_GAPS = {
    "grammar-97be9143e9": LOOKAHEAD,  # r ::= ("x" | "yy") (=[0-3]), followed by [0-9a-z] or "y"
    "grammar-ff8f951740": LOOKAHEAD,  # c ::= "a" | "b" (=[a-z] "b"), followed by d ::= "ac" | ...
}


def walk_text(ref, r):
    # Both engines let a string take an encoded surrogate (ED A0..BF ..) where a class reaches U+D800-U+DFFF.
    return b"".join(ref.tokens[t] for t in r["tokens"] if t != EOS).decode("utf-8", "surrogatepass")


_TOKENIZER = {}


def tokenize(tiny_dir, text):  # noqa: F811
    if tiny_dir not in _TOKENIZER:
        import tokenizers
        _TOKENIZER[tiny_dir] = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    return _TOKENIZER[tiny_dir].encode(text, add_special_tokens=False).ids


def _fail_or_skip(why):
    if os.environ.get("KESTREL_REQUIRE_XGRAMMAR"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def corpus():
    try:
        sources = xc.fetch_sources()
    except Exception as e:  # noqa: BLE001 (a download failure of any kind)
        _fail_or_skip(f"xgrammar's source distribution could not be had: {e}")
    assert len(sources) >= 20, sorted(sources)
    return xc.collect(sources)


class Engines:
    def __init__(self, tiny_dir):  # noqa: F811
        self.tiny_dir = tiny_dir
        self.xgr = gp.import_xgrammar()
        self.probe = gp.Probe(tiny_dir, VOCAB_SIZE, [EOS])
        self.vocab = self.probe.ask({"cmd": "vocab"})
        self.ref = gp.Reference(self.xgr, self.vocab)

    def ask(self, req):
        """Kestrel's answer; a probe that dies (a crash) is restarted and the crash returned as such."""
        try:
            return self.probe.ask(req)
        except (AssertionError, BrokenPipeError, ValueError) as e:
            self.probe = gp.Probe(self.tiny_dir, VOCAB_SIZE, [EOS])
            return {"crash": f"grammar_probe died: {e}"}


@pytest.fixture(scope="module")
def engines(tiny_dir):  # noqa: F811
    e = Engines(tiny_dir)
    yield e
    e.probe.close()


def has_pattern_with_length(v):
    """Whether some schema in v has a 'pattern' beside 'minLength' or 'maxLength'."""
    if isinstance(v, dict):
        if "pattern" in v and ("minLength" in v or "maxLength" in v):
            return True
        return any(has_pattern_with_length(x) for x in v.values())
    return isinstance(v, list) and any(has_pattern_with_length(x) for x in v)


def documented_difference(kind, spec):
    """The reason Kestrel reads this schema differently from xgrammar on purpose (docs/structured-output.md), or
    None."""
    if kind != "json_schema":
        return None
    text = json.dumps(spec)
    if '"format"' in text:
        return FORMAT
    if has_pattern_with_length(spec):
        return PATTERN_LENGTH
    if '"minLength"' in text or '"maxLength"' in text:
        return LENGTH
    if re.search(r'"maxItems"', text) and '"prefixItems"' in text:
        return "maxItems below the prefixItems' count shortens the tuple"

    def typed(s, v):
        t = s.get("type")
        names = t if isinstance(t, list) else [t]
        kinds = {"null": v is None, "boolean": isinstance(v, bool), "string": isinstance(v, str),
                 "array": isinstance(v, list), "object": isinstance(v, dict),
                 "number": isinstance(v, (int, float)) and not isinstance(v, bool),
                 "integer": isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()}
        return t is None or not names or any(kinds.get(n, True) for n in names if isinstance(n, str))

    def walk(s, reached):
        if isinstance(s, dict):
            values = s.get("enum", []) if isinstance(s.get("enum"), list) else []
            values = values + ([s["const"]] if "const" in s else [])
            if any(not typed(s, v) for v in values):
                return ENUM_TYPE

            if reached and s in ({"type": "array"}, {"type": "object"}):
                return "a bare array/object schema through allOf/$ref is any array/object"
            if "type" not in s and s and set(s) <= {"minLength", "maxLength", "pattern", "format", "minimum",
                                                    "maximum", "exclusiveMinimum", "exclusiveMaximum", "title",
                                                    "description"}:
                return "a schema without type whose keywords are a string's or a number's"
            for k, v in s.items():
                r = walk(v, reached or k in ("allOf", "$defs", "definitions"))
                if r:
                    return r
        elif isinstance(s, list):
            for v in s:
                r = walk(v, reached)
                if r:
                    return r
        return None

    return walk(spec, False)


def _kestrel_error_reason(msg):
    """A short category of a Kestrel compile error, for the counts."""
    msg = re.sub(r"(?<![A-Za-z])'[^']*'", "'…'", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:110]


def first_diff(r, xmasks, ref, spec_text):
    for i, (mine, theirs) in enumerate(zip(r["masks"], xmasks)):
        a = gp.mask_int(mine)
        if a != theirs and not deviation_ok(ref, a, theirs, spec_text):
            return i
    return None


SELF_INCONSISTENT = "xgrammar's own matcher agrees with Kestrel on every differing token"


def self_check(e, compiled, r, step):
    """Whether xgrammar's matcher, fed the walk's tokens then each token where the masks differ, accepts exactly
    the ones Kestrel's mask allows (its mask then disagrees with its own matcher)."""
    a, b = gp.mask_int(r["masks"][step]), r["xmasks"][step]
    diff = [t for t in range(e.ref.V) if (a ^ b) >> t & 1]
    for t in diff[:64]:
        m = e.xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(x) for x in r["tokens"][:step])
        if m.accept_token(t) != bool(a >> t & 1):
            return ""
    return f" [{SELF_INCONSISTENT}]"


def run_case(e, cid, case, rng, stats):
    """Returns None when both engines agree, else a description of the first difference. Updates stats."""
    kind, spec = case["kind"], case["spec"]
    k = e.ask({"cmd": "walk", "kind": kind, "spec": spec, "tokens": []})
    if "crash" in k:
        return f"Kestrel crashed compiling it: {k['crash']}"
    try:
        compiled = e.ref.compile(kind, spec)
        xerr = None
    except Exception as x:  # noqa: BLE001 (xgrammar raises RuntimeError, ValueError, ...)
        compiled, xerr = None, str(x)
    if "error" in k or xerr is not None:
        if "error" in k and xerr is not None:
            stats["skipped"][(kind, "both refuse it")] += 1
        elif xerr is not None:
            stats["skipped"][(kind, "xgrammar refuses it (Kestrel compiles it)")] += 1
        else:
            stats["skipped"][(kind, "Kestrel refuses: " + _kestrel_error_reason(k["error"]))] += 1
        return None
    stats["run"][kind] += 1
    spec_text = json.dumps(spec)
    for w in range(WALKS):
        r = e.ask({"cmd": "walk", "kind": kind, "spec": spec, "seed": rng.randrange(1 << 30), "steps": STEPS})
        if "crash" in r or "error" in r:
            return f"Kestrel walk failed: {r}"
        xmasks, refused = e.ref.masks(compiled, r["tokens"])
        r["xmasks"] = xmasks
        bad = first_diff(r, xmasks, e.ref, spec_text)
        if bad is not None:
            return f"walk {w}: masks differ at step {bad}: {show(e.ref, r, bad)}" + self_check(e, compiled, r, bad)
        if refused is not None:
            return f"walk {w}: xgrammar refuses token {r['tokens'][refused]} that both masks allowed"
        stats["walk_steps"] += len(r["masks"])
        if r["terminated"]:
            stats["ended"][kind] += 1
            if kind == "json_schema":
                out = walk_text(e.ref, r)
                try:
                    jsonschema.validate(json.loads(out), as_anyof(spec))
                    stats["validated"] += 1
                except jsonschema.ValidationError as x:
                    return f"walk {w}: the output {out!r} breaks the schema: {x.message}"
                except Exception:  # noqa: BLE001 (a schema jsonschema cannot read: unresolvable $ref, ...)
                    stats["not_validated"] += 1
        # An invalid-by-construction continuation: a token outside the mask at a random step, refused by both.
        step = rng.randrange(len(r["masks"]))
        mask = gp.mask_int(r["masks"][step])
        outside = [t for t in range(e.ref.V) if not mask >> t & 1 and e.ref.tokens[t]]
        if outside and not (r["terminated"] and step == len(r["masks"]) - 1):
            t = rng.choice(outside)
            toks = r["tokens"][:step] + [t]
            k2 = e.ask({"cmd": "walk", "kind": kind, "spec": spec, "tokens": toks})
            _, xref = e.ref.masks(compiled, toks)
            if "refused" not in k2.get("error", "") or xref != step:
                return f"walk {w}: token {t} outside the mask at step {step}: Kestrel {k2.get('error')}, " \
                       f"xgrammar refused at {xref}"
            stats["invalid_refused"] += 1
    for text, verdict in case["instances"]:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            stats["instances_skipped"] += 1  # a lone surrogate: not a text a tokenizer writes
            continue
        tokens = tokenize(e.tiny_dir, text) + [EOS]
        k2 = e.ask({"cmd": "walk", "kind": kind, "spec": spec, "tokens": tokens})
        if "crash" in k2:
            return f"Kestrel crashed on instance {text!r}: {k2['crash']}"
        xmasks, xref = e.ref.masks(compiled, tokens)
        kref = None
        if "error" in k2:
            m = re.match(r"token (\d+) refused after (\d+) tokens", k2["error"])
            assert m, k2
            kref = int(m.group(2))
            k2 = e.ask({"cmd": "walk", "kind": kind, "spec": spec, "tokens": tokens[:kref]})
        k2["xmasks"] = xmasks
        bad = first_diff(k2, xmasks, e.ref, spec_text)
        if bad is not None:
            return f"instance {text!r}: masks differ at step {bad}: {show(e.ref, k2, bad)}"
        if kref != xref:
            return f"instance {text!r}: Kestrel refuses at token {kref}, xgrammar at {xref}"
        stats["instances"] += 1
        stats["instances_refused" if kref is not None else "instances_accepted"] += 1
        if kind == "json_schema":
            try:
                value = json.loads(text)
                jsonschema.validate(value, as_anyof(spec))
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            except Exception:  # noqa: BLE001 (a schema jsonschema cannot read)
                valid = None
            if valid is False:
                if kref is None:
                    return f"instance {text!r}: invalid under jsonschema, accepted by both engines"
                stats["invalid_instances_refused"] += 1
    return None


def test_xgrammar_own_test_cases(corpus, engines):
    cases, not_literal = corpus
    t0 = time.monotonic()
    found = Counter(c["kind"] for c in cases.values())
    stats = {"run": Counter(), "skipped": Counter(), "ended": Counter(), "walk_steps": 0, "validated": 0, "not_validated": 0,
             "invalid_refused": 0, "instances": 0, "instances_refused": 0, "instances_accepted": 0,
             "invalid_instances_refused": 0, "instances_skipped": 0}
    differ, documented = {}, {}
    for cid in sorted(cases):
        case = cases[cid]
        why = run_case(engines, cid, case, random.Random(cid), stats)
        if why is None:
            continue
        differ[cid] = f"{case['where'][0]} {json.dumps(case['spec'])[:300]}: {why}"
        doc = documented_difference(case["kind"], case["spec"])
        if doc is not None and "crash" not in why:
            documented[cid] = doc
    elapsed = time.monotonic() - t0

    lines = [f"xgrammar {xc.pinned_version()} test files: cases found (distinct) / run by both / skipped"]
    for kind in ("json_schema", "grammar", "regex"):
        sk = sum(v for (k, _), v in stats["skipped"].items() if k == kind)
        lines.append(f"  {kind}: {found[kind]} / {stats['run'][kind]} / {sk}")
    for (kind, why), n in sorted(stats["skipped"].items()):
        lines.append(f"    skipped {kind}: {n} x {why}")
    for (kind, why), n in sorted(not_literal.items()):
        lines.append(f"    not collected ({kind} argument not a literal): {n} x {why}")
    for cid, why in sorted(documented.items()):
        lines.append(f"    differs on purpose: {cid} ({cases[cid]['where'][0]}): {why}")
    for cid in sorted(set(differ) & set(KNOWN_GAPS)):
        lines.append(f"    known gap: {cid} ({cases[cid]['where'][0]}): {KNOWN_GAPS[cid][:60]}...")
    lines.append(f"  walk steps compared {stats['walk_steps']}, walks ended {dict(stats['ended'])}, "
                 f"validated by jsonschema {stats['validated']} (schema unreadable by jsonschema {stats['not_validated']}), invalid tokens refused by both "
                 f"{stats['invalid_refused']}")
    lines.append(f"  instances replayed {stats['instances']} (refused by both {stats['instances_refused']}, "
                 f"accepted by both {stats['instances_accepted']}, invalid under jsonschema and refused "
                 f"{stats['invalid_instances_refused']}, not a UTF-8 text {stats['instances_skipped']})")
    lines.append(f"  known gaps {len(KNOWN_GAPS)}, time {elapsed:.1f} s")
    print("\n".join(lines))

    unexplained = {c: w for c, w in differ.items()
                   if c not in KNOWN_GAPS and not (c in ON_PURPOSE and documented.get(c) == ON_PURPOSE[c])}
    # The lookahead gaps are xgrammar's mask disagreeing with its own matcher, which agrees with Kestrel.
    for c in set(differ) & {c for c, why in KNOWN_GAPS.items() if why == LOOKAHEAD}:
        assert SELF_INCONSISTENT in differ[c], differ[c]
    vanished = sorted((set(KNOWN_GAPS) | set(ON_PURPOSE)) - set(differ))
    assert not unexplained, "masks differ from xgrammar's:\n" + "\n".join(f"{c}: {w}" for c, w in unexplained.items())
    assert not vanished, f"known gaps or deliberate differences that no longer differ (remove them from KNOWN_GAPS / ON_PURPOSE): {vanished}"
    # The corpus is xgrammar's: it must still be there in size, and most of it must run on both engines.
    assert found["json_schema"] >= 300 and found["grammar"] >= 300 and found["regex"] >= 50, found
    assert stats["run"]["json_schema"] >= 200 and stats["run"]["grammar"] >= 200 and stats["run"]["regex"] >= 30, \
        stats["run"]
    assert stats["instances_refused"] >= 100 and stats["instances_accepted"] >= 100, stats
