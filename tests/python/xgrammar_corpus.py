"""xgrammar's own test inputs, read at test time (test_grammar_parity_xgr_corpus.py): the source distribution of the
xgrammar version pinned in requirements-grammar.txt is downloaded with pip into a temporary folder, its
tests/python/*.py are parsed (never imported, never run) and the literal JSON schemas, EBNF grammars and regexes
handed to xgrammar's compile and check calls are collected by walking the Python syntax tree. Nothing of xgrammar's
is kept in Kestrel's repository.

What is collected: a literal (or a name bound to one: an assignment in the function or module, a `for` loop over a
literal list, a pytest.mark.parametrize row) passed as the grammar argument of Grammar.from_json_schema /
from_ebnf / from_regex, GrammarCompiler.compile_json_schema / compile_grammar / compile_regex, the testing helpers
_json_schema_to_ebnf / _regex_to_ebnf / _ebnf_to_grammar_no_normalization / _is_grammar_accept_string, and the test
files' own helper functions that pass one of their parameters on to those (found by propagation). json.dumps(x) of
a literal counts as the literal. With the grammar, the strings the same test checks (`assert [not]
_is_grammar_accept_string(G, S)`, or a helper's instance and is_accepted arguments) are kept as instances with
xgrammar's expected verdict. What is not a literal (a pydantic model's schema, a string built by code) is counted
by reason, not collected."""

import ast
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent / "requirements-grammar.txt"

# call name -> (kind, index of the grammar argument, its keyword name)
SINKS = {
    "from_json_schema": ("json_schema", 0, "schema"),
    "compile_json_schema": ("json_schema", 0, "schema"),
    "_json_schema_to_ebnf": ("json_schema", 0, "schema"),
    "from_ebnf": ("grammar", 0, "ebnf_string"),
    "compile_grammar": ("grammar", 0, "grammar"),
    "_ebnf_to_grammar_no_normalization": ("grammar", 0, "ebnf_string"),
    "_is_grammar_accept_string": ("grammar", 0, "grammar"),
    "from_regex": ("regex", 0, "regex"),
    "compile_regex": ("regex", 0, "regex"),
    "_regex_to_ebnf": ("regex", 0, "regex"),
}
INSTANCE_NAMES = ("instance", "input", "input_str", "string", "text", "value", "s", "test_string", "input_string")
VERDICT_NAMES = ("accepted", "is_accepted", "expected", "accept", "is_accept", "should_accept", "expected_accepted")


def pinned_version():
    for line in REQUIREMENTS.read_text().splitlines():
        m = re.match(r"\s*xgrammar==([\w.]+)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"no xgrammar==VERSION in {REQUIREMENTS}")


def download_sdist(dest):
    """The pinned version's source archive, with pip (its metadata step needs the build backends of
    requirements.txt installed: no build happens). Returns the archive's path; raises with pip's output."""
    version = pinned_version()
    cmd = [sys.executable, "-m", "pip", "download", f"xgrammar=={version}", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-q", "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    archives = sorted(Path(dest).glob(f"xgrammar-{version}.tar.gz"))
    if r.returncode != 0 or not archives:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return archives[0]


def test_sources(archive):
    """{file name: source text} of the archive's tests/python/*.py."""
    out = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) == 4 and parts[1:3] == ["tests", "python"] and parts[3].endswith(".py") and member.isfile():
                out[parts[3]] = tar.extractfile(member).read().decode("utf-8")
    return out


def fetch_sources():
    cache = os.environ.get("KESTREL_XGRAMMAR_SDIST")  # a downloaded archive, to skip the download when iterating
    if cache:
        return test_sources(cache)
    with tempfile.TemporaryDirectory() as tmp:
        return test_sources(download_sdist(tmp))


# ---------------------------------------------------------------- the syntax tree walk

class _NotLiteral(Exception):
    def __init__(self, why):
        super().__init__(why)
        self.why = why


def _call_name(node):
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return None


def _why_not(node):
    """A short reason an expression is not a literal."""
    if isinstance(node, ast.Call):
        name = _call_name(node) or "?"
        if name in ("model_json_schema", "json_schema") or name.endswith("Model"):
            return "pydantic model"
        return f"built by a call ({name})"
    if isinstance(node, (ast.JoinedStr, ast.BinOp)):
        return "built by code (f-string or operator)"
    if isinstance(node, ast.Name):
        return "a name bound to no literal"
    return f"not a literal ({type(node).__name__})"


class _Module:
    def __init__(self, name, tree):
        self.name = name
        self.tree = tree
        self.consts = {}  # module-level name -> value node (last assignment)
        self.funcs = {}
        for st in tree.body:
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                self.consts[st.targets[0].id] = st.value
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                self.consts[st.target.id] = st.value
            elif isinstance(st, ast.FunctionDef):
                self.funcs[st.name] = st


def _literal(node, mod, scope, depth=0):
    """The Python value of an expression made of literals, names bound to literals and json.dumps/copy of them."""
    if depth > 8:
        raise _NotLiteral("too deep")
    if isinstance(node, ast.Name):
        if node.id in scope:
            v = scope[node.id]
            if isinstance(v, _NotLiteral):
                raise v
            return v
        if node.id in mod.consts:
            return _literal(mod.consts[node.id], mod, {}, depth + 1)
        raise _NotLiteral("a name bound to no literal")
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name == "dumps" and node.args:
            v = _literal(node.args[0], mod, scope, depth + 1)
            return json.dumps(v)
        if name in ("deepcopy", "copy") and node.args:
            return _literal(node.args[0], mod, scope, depth + 1)
        if name == "param" and isinstance(node.func, ast.Attribute):  # pytest.param(a, b, id=...)
            return tuple(_literal(a, mod, scope, depth + 1) for a in node.args)
        if name == "dedent" and node.args:
            import textwrap
            return textwrap.dedent(_literal(node.args[0], mod, scope, depth + 1))
        raise _NotLiteral(_why_not(node))
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return type({ast.List: [], ast.Tuple: (), ast.Set: []}[type(node)])(
            _literal(e, mod, scope, depth + 1) for e in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _NotLiteral("dict with ** expansion")
        return {_literal(k, mod, scope, depth + 1): _literal(v, mod, scope, depth + 1)
                for k, v in zip(node.keys, node.values)}
    try:
        return ast.literal_eval(node)
    except Exception:
        raise _NotLiteral(_why_not(node))


def _param_rows(func, mod):
    """The parametrize bindings of a test function: a list of {name: value or _NotLiteral}, [{}] when none."""
    tables = []
    for dec in func.decorator_list:
        if not (isinstance(dec, ast.Call) and _call_name(dec) == "parametrize" and len(dec.args) >= 2):
            continue
        try:
            names = _literal(dec.args[0], mod, {})
        except _NotLiteral:
            continue
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows_node = dec.args[1]
        if isinstance(rows_node, ast.Name) and rows_node.id in mod.consts:
            rows_node = mod.consts[rows_node.id]
        rows = []
        if isinstance(rows_node, (ast.List, ast.Tuple)):
            for e in rows_node.elts:
                if isinstance(e, ast.Call) and _call_name(e) == "param":
                    e = ast.Tuple(elts=e.args, ctx=ast.Load())
                if len(names) == 1:
                    elts = [e]
                elif isinstance(e, (ast.Tuple, ast.List)) and len(e.elts) == len(names):
                    elts = e.elts
                else:
                    elts = None
                row = {}
                for i, n in enumerate(names):
                    if elts is None:
                        row[n] = _NotLiteral("parametrize row not a tuple of literals")
                        continue
                    try:
                        row[n] = _literal(elts[i], mod, {})
                    except _NotLiteral as x:
                        row[n] = x
                rows.append(row)
        else:
            rows.append({n: _NotLiteral("parametrize rows built by code") for n in names})
        tables.append(rows)
    if not tables:
        return [{}]
    out = []
    for combo in itertools.product(*tables):
        d = {}
        for r in combo:
            d.update(r)
        out.append(d)
    return out


def _args_of(call, sink):
    """{role: node} of a call to a sink: 'grammar', and 'instance' / 'verdict' where the sink has them."""
    idx, kw = sink["index"], sink["keyword"]
    out = {}
    if len(call.args) > idx and not isinstance(call.args[idx], ast.Starred):
        out["grammar"] = call.args[idx]
    for k in call.keywords:
        if k.arg == kw:
            out["grammar"] = k.value
    for role in ("instance", "verdict"):
        pos = sink.get(role)
        if pos is None:
            continue
        i, name = pos
        if len(call.args) > i:
            out[role] = call.args[i]
        for k in call.keywords:
            if k.arg == name:
                out[role] = k.value
    return out


def _sinks_for(mods):
    """SINKS plus every test-file function that passes one of its parameters on as a sink's grammar argument
    (and, for a checker, its instance and verdict parameters), to a fixed point."""
    sinks = {n: {"kind": k, "index": i, "keyword": kw} for n, (k, i, kw) in SINKS.items()}
    sinks["_is_grammar_accept_string"].update(instance=(1, "input_str"))
    changed = True
    while changed:
        changed = False
        for mod in mods:
            for fname, func in mod.funcs.items():
                if fname in sinks or fname.startswith("test_"):
                    continue
                params = [a.arg for a in func.args.args]
                for call in ast.walk(func):
                    if not isinstance(call, ast.Call) or _call_name(call) not in sinks:
                        continue
                    inner = sinks[_call_name(call)]
                    node = _args_of(call, inner).get("grammar")
                    if isinstance(node, ast.Call) and _call_name(node) == "dumps" and node.args:
                        node = node.args[0]
                    if isinstance(node, ast.Name) and node.id in params:
                        s = {"kind": inner["kind"], "index": params.index(node.id), "keyword": node.id}
                        for role, names in (("instance", INSTANCE_NAMES), ("verdict", VERDICT_NAMES)):
                            for n in names:
                                if n in params:
                                    s[role] = (params.index(n), n)
                                    break
                        sinks[fname] = s
                        changed = True
                        break
    return sinks


def _scopes(func, mod, row):
    """Local bindings of a function for one parametrize row, by line: [(line, {name: value})] in order, from
    assignments of literals and `for` loops over literal lists (each element a binding of its own)."""
    base = dict(row)
    events = []
    for st in ast.walk(func):
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            v = st.value
            if isinstance(v, ast.Call) and _call_name(v) in SINKS and _call_name(v) != "_is_grammar_accept_string":
                # grammar = Grammar.from_ebnf(text): the grammar is the text, of the sink's kind
                kind, idx, kw = SINKS[_call_name(v)]
                arg = v.args[idx] if len(v.args) > idx else next((k.value for k in v.keywords if k.arg == kw), None)
                if arg is not None:
                    events.append((st.lineno, st.targets[0].id, [_Derived(kind, arg)]))
                    continue
            try:
                events.append((st.lineno, st.targets[0].id, [_literal(v, mod, base)]))
            except _NotLiteral as x:
                events.append((st.lineno, st.targets[0].id, [x]))
        elif isinstance(st, ast.For):
            try:
                seq = _literal(st.iter, mod, base)
            except _NotLiteral:
                continue
            if isinstance(st.target, ast.Name):
                events.append((st.lineno, st.target.id, list(seq)))
            elif isinstance(st.target, ast.Tuple) and all(isinstance(t, ast.Name) for t in st.target.elts):
                for j, t in enumerate(st.target.elts):
                    events.append((st.lineno, t.id, [v[j] if isinstance(v, (list, tuple)) and len(v) > j
                                                     else _NotLiteral("loop element") for v in seq]))
    return base, sorted(events, key=lambda e: e[0])


class _Derived:
    """A name bound to a sink's result (grammar = Grammar.from_ebnf(text)): stands for that sink's argument."""

    def __init__(self, kind, node):
        self.kind, self.node = kind, node


def _values(node, mod, base, events, line, kind, depth=0):
    """All (kind, value) an argument takes at a line: a literal, or a name whose latest binding before the line is a
    literal (a loop binding gives several), or a name bound to a sink's result (that sink's argument and kind)."""
    if depth > 6:
        raise _NotLiteral("too deep")
    if isinstance(node, ast.Name):
        latest, at = None, line
        for ln, name, vals in events:
            if name == node.id and ln <= line:
                latest, at = vals, ln
        if latest is not None:
            out = []
            for v in latest:
                if isinstance(v, _NotLiteral):
                    raise v
                if isinstance(v, _Derived):
                    out += _values(v.node, mod, base, events, at - 1 if isinstance(v.node, ast.Name) and
                                   v.node.id == node.id else at, v.kind, depth + 1)
                else:
                    out.append((kind, v))
            return out
    if isinstance(node, ast.Call) and _call_name(node) == "dumps" and node.args and isinstance(node.args[0], ast.Name):
        return [(k, json.dumps(v)) for k, v in _values(node.args[0], mod, base, events, line, kind, depth + 1)]
    if isinstance(node, ast.Call) and _call_name(node) in SINKS and _call_name(node) != "_is_grammar_accept_string":
        k2, idx, kw = SINKS[_call_name(node)]
        arg = node.args[idx] if len(node.args) > idx else next((k.value for k in node.keywords if k.arg == kw), None)
        if arg is not None:
            return _values(arg, mod, base, events, line, k2, depth + 1)
    return [(kind, _literal(node, mod, base))]


def case_id(kind, spec):
    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=False)
    return f"{kind}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


def collect(sources):
    """Returns (cases, skipped): cases is {id: {"kind", "spec", "where": [file:line], "instances": [(text, verdict or
    None)]}}; skipped is a Counter of (kind, reason) for the grammar arguments that are not literals."""
    mods = [_Module(name, ast.parse(text)) for name, text in sorted(sources.items())]
    sinks = _sinks_for(mods)
    cases, skipped = {}, Counter()
    for mod in mods:
        funcs = [n for n in ast.walk(mod.tree) if isinstance(n, ast.FunctionDef)]
        module_calls = [n for st in mod.tree.body if not isinstance(st, (ast.FunctionDef, ast.ClassDef))
                        for n in ast.walk(st)]
        for func, calls in [(f, list(ast.walk(f))) for f in funcs] + [(None, module_calls)]:
            rows = _param_rows(func, mod) if func is not None else [{}]
            params = {a.arg for a in func.args.args} if func is not None else set()
            seen_sites = set()
            for row in rows:
                base, events = _scopes(func, mod, row) if func is not None else ({}, [])
                for call in calls:
                    if not isinstance(call, ast.Call) or _call_name(call) not in sinks:
                        continue
                    sink = sinks[_call_name(call)]
                    args = _args_of(call, sink)
                    node = args.get("grammar")
                    if node is None:
                        continue
                    # A helper's own forwarding call (its grammar argument is its parameter) is not a case.
                    if func is not None and func.name in sinks and isinstance(node, ast.Name) and node.id in params \
                            and node.id not in row:
                        continue
                    if func is not None and func.name in sinks and isinstance(node, ast.Call) and \
                            _call_name(node) == "dumps" and node.args and isinstance(node.args[0], ast.Name) and \
                            node.args[0].id in params:
                        continue
                    site = (mod.name, call.lineno, call.col_offset)
                    try:
                        vals = _values(node, mod, base, events, call.lineno, sink["kind"])
                    except _NotLiteral as x:
                        if site not in seen_sites:
                            skipped[(sink["kind"], x.why)] += 1
                            seen_sites.add(site)
                        continue
                    inst, verdict = None, None
                    if "instance" in args:
                        try:
                            iv = _values(args["instance"], mod, base, events, call.lineno, "")
                            inst = iv[0][1] if len(iv) == 1 else None
                        except _NotLiteral:
                            inst = None
                    if "verdict" in args:
                        try:
                            vv = _values(args["verdict"], mod, base, events, call.lineno, "")
                            verdict = vv[0][1] if len(vv) == 1 and isinstance(vv[0][1], bool) else None
                        except _NotLiteral:
                            verdict = None
                    elif _call_name(call) == "_is_grammar_accept_string" and inst is not None:
                        verdict = _assert_verdict(func, call)
                    for vkind, v in vals:
                        kind, spec, why = _normalise(vkind, v)
                        if spec is None:
                            skipped[(kind, why)] += 1
                            continue
                        cid = case_id(kind, spec)
                        c = cases.setdefault(cid, {"kind": kind, "spec": spec, "where": [], "instances": []})
                        w = f"{mod.name}:{call.lineno}"
                        if w not in c["where"]:
                            c["where"].append(w)
                        if inst is not None:
                            text = inst if isinstance(inst, str) else json.dumps(inst)
                            if (text, verdict) not in c["instances"]:
                                c["instances"].append((text, verdict))
    return cases, skipped


def _assert_verdict(func, call):
    """True / False when the call is `assert f(...)` / `assert not f(...)` (or `f(...) == True/False`)."""
    if func is None:
        return None
    for st in ast.walk(func):
        if isinstance(st, ast.Assert):
            t = st.test
            if t is call:
                return True
            if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and t.operand is call:
                return False
    return None


def _normalise(kind, v):
    """(kind, spec, why): a JSON schema as a parsed value, a grammar or regex as a string; spec None when the value
    is not one."""
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                return kind, None, "schema text is not JSON"
        if isinstance(v, (dict, bool)):
            return kind, v, None
        return kind, None, f"schema is a {type(v).__name__}"
    if not isinstance(v, str):
        return kind, None, f"{kind} is a {type(v).__name__}"
    return kind, v, None
