"""Golden tests of Kestrel's Jinja chat-template interpreter against Python jinja2, configured the way Hugging
Face transformers renders chat templates (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, json.dumps-based tojson, raise_exception).

- Expression/statement snippets: many small templates over a fixed context, each rendered by both.
- Chat templates written here in the style of the published Kimi and DeepSeek templates (tools, tool results,
  thinking blocks, multi-turn histories, macros, namespaces), plus the make-model template, on many
  deterministic message lists.
- Errors: templates that raise, and unknown syntax, fail in both.
"""

import json
import random

import pytest

import text_corpus
from text_harness import batch, kestrel_bin, report

jinja2 = pytest.importorskip("jinja2")
from jinja2.ext import loopcontrols  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402


class RaisedByTemplate(Exception):
    pass


def _raise_exception(message):
    raise RaisedByTemplate(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def render_ref(template, context):
    return _env().from_string(template).render(**context)


CONTEXT = {
    "s": "  Hello, World! ",
    "cjk": "你好，世界 😀",
    "n": 7,
    "neg": -7,
    "f": 2.5,
    "big": 12345678901234,
    "tiny": 1e-7,
    "huge": 1.5e300,
    "third": 0.1 + 0.2,
    "t": True,
    "nothing": None,
    "xs": [3, 1, 2],
    "words": ["banana", "Apple", "cherry", "apple"],
    "d": {"b": 1, "a": [1, 2.0, None, True, "x\"y"], "c": {"nested": "ü\n\t<>&'"}},
    "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "name": "bot"},
             {"role": "tool", "content": None}],
    "empty": [],
    "text": "line one\nline two\r\nline three\n",
}

SNIPPETS = [
    "{{ s }}|{{ s | trim }}|{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.strip(' H!') }}",
    "{{ s | length }} {{ cjk | length }} {{ xs | length }} {{ d | length }} {{ empty | count }}",
    "{{ s.upper() }} {{ s.lower() }} {{ s | upper }} {{ 'hello world' | title }} {{ 'hELLO' | capitalize }}",
    "{{ s.split(',') }} {{ s.split() }} {{ 'a,b,,c'.split(',', 1) }} {{ 'a b  c'.rsplit(None, 1) }} {{ 'x-y-z'.rsplit('-', 1) }}",
    "{{ s.startswith('  He') }} {{ s.endswith(('x', ' ')) }} {{ s.find('World') }} {{ cjk.find('世') }} {{ s.count('l') }}",
    "{{ s.replace('l', 'L') }} {{ s | replace('l', '_', 2) }} {{ '-'.join(words) }} {{ words | join(', ') }}",
    "{{ n + 1 }} {{ n - 10 }} {{ n * 3 }} {{ n / 2 }} {{ n // 2 }} {{ neg // 2 }} {{ n % 3 }} {{ neg % 3 }} {{ 2 ** 10 }}",
    "{{ f }} {{ f * 2 }} {{ n / 7 }} {{ tiny }} {{ huge }} {{ third }} {{ big }} {{ 1e16 }} {{ 1.0e15 }} {{ 0.0001 }} {{ -0.0 }}",
    "{{ f | round }} {{ 3.14159 | round(2) }} {{ 2.5 | round(0, 'floor') }} {{ f | int }} {{ '42' | int }} {{ 'x' | int(5) }} {{ '1.5' | float }} {{ n | float }}",
    "{{ t }} {{ nothing }} {{ xs }} {{ d }} {{ words[1:] }} {{ words[::-1] }} {{ words[-1] }} {{ cjk[0] }} {{ cjk[-1] }} {{ s[2:7] }}",
    "{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ d | tojson(separators=(',', ':')) }}|{{ d | tojson(sort_keys=true) }}",
    "{{ cjk | tojson }} {{ cjk | tojson(ensure_ascii=true) }} {{ msgs | tojson }} {{ nothing | tojson }} {{ [f, n, t] | tojson }}",
    "{% for x in xs %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }};{% endfor %}",
    "{% for x in xs %}{{ loop.previtem }}>{{ x }}>{{ loop.nextitem }} {{ loop.cycle('a', 'b') }}|{% endfor %}",
    "{% for x in xs if x > 1 %}{{ x }}{{ ',' if not loop.last }}{% else %}none{% endfor %}{% for y in empty %}y{% else %}empty{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}{% for k, v in d | dictsort %}{{ k }}{% endfor %}",
    "{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% set ns = namespace(total=0, seen=[]) %}{% for x in xs %}{% set ns.total = ns.total + x %}{% endfor %}{{ ns.total }}",
    "{% set a = 1 %}{% for x in xs %}{% set a = x %}{% endfor %}{{ a }}{% if true %}{% set b = 5 %}{% endif %}{{ b }}",
    "{% set block %}  inner {{ n }}  {% endset %}[{{ block }}]{% set up | upper %}abc{% endset %}{{ up }}",
    "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', '?') }} {{ greet(name='Cy', punct='.') }}",
    "{% macro render(m) %}{% if m.content is string %}{{ m.role }}:{{ m.content }}{% elif m.content is none %}{{ m.role }}:-{% endif %}{% endmacro %}{% for m in msgs %}{{ render(m) }}|{% endfor %}",
    "{{ msgs | selectattr('role', 'equalto', 'user') | list | length }} {{ msgs | map(attribute='role') | join(',') }} {{ msgs | rejectattr('content') | list | length }}",
    "{{ xs | sort }} {{ xs | sort(reverse=true) }} {{ words | sort }} {{ words | sort(case_sensitive=true) }} {{ words | unique | list }} {{ xs | max }} {{ xs | min }} {{ xs | sum }}",
    "{{ xs | first }} {{ xs | last }} {{ xs | reverse | list }} {{ 'abc' | reverse }} {{ xs | select('odd') | list }} {{ xs | reject('even') | list }} {{ xs | map('string') | join }}",
    "{{ nothing is none }} {{ n is number }} {{ n is integer }} {{ f is float }} {{ s is string }} {{ d is mapping }} {{ xs is sequence }} {{ undefined_thing is defined }} {{ t is boolean }}",
    "{{ n is odd }} {{ n is even }} {{ n is divisibleby(7) }} {{ n is divisibleby 2 }} {{ xs is iterable }} {{ 'a' is in 'cat' }} {{ n is eq 7 }} {{ n is gt 3 }} {{ nothing is not none }}",
    "{{ 'a' in 'cat' }} {{ 1 in xs }} {{ 'b' in d }} {{ 'z' not in d }} {{ 5 not in xs }} {{ 1 < n < 10 }} {{ n == 7.0 }} {{ t == 1 }} {{ [1, 2] == [1, 2] }} {{ 'b' > 'a' }}",
    "{{ nothing or 'default' }} {{ n and 'yes' }} {{ empty or 'e' }} {{ not empty }} {{ 'x' if t else 'y' }} {{ 'x' if nothing }}|{{ undefined_thing | default('dflt') }} {{ '' | default('e', true) }}",
    "{{ n ~ '/' ~ f ~ '/' ~ nothing ~ '/' ~ t }} {{ 'ab' * 3 }} {{ xs + [9] }} {{ -n }} {{ -f }} {{ (1, 2) }} {{ (1,) }} {{ () }}",
    "{{ text | indent(2) }}|{{ text | indent(4, first=true) }}|{{ 'a\n\nb' | indent(2, blank=true) }}|{{ text.splitlines() }}",
    "{{ '%s has %d items' | format('list', 3) }} {{ '{} and {}'.format('a', n) }} {{ '{0}{0}'.format('z') }} {{ 'one two three' | wordcount }}",
    "{{ d.get('b') }} {{ d.get('zz', 'none') }} {{ d.get('zz') }} {{ d.keys() | list }} {{ d.values() | list | length }} {{ d['c']['nested'] }} {{ d.c.nested | e }}",
    "{{ xs.index(2) }} {{ words.count('apple') }} {{ d.items() | list | first }} {{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ dict(a=1, b='x') }}",
    "{{ 'ab\\ncd' }}{{ \"q'uote\" }}{{ 'unicode: \\u00e9 \\x41' }} {{ 'tab\\there' }}{{ 'adj' 'acent' }} {{ 1_000 }} {{ 1.5e3 }}",
    "{#- comment -#}  a  {#- another #}\n  b  {# keep #}  c",
    "x\n  {% if t %}\n    yes\n  {% endif %}\ny\n{%- if t %}  z  {% endif -%}\n  w\n{%+ if t %}p{% endif %}",
    "{% raw %}{{ not rendered }}{% if %}{% endraw %}after\n{{- '  stripped' -}}\n  end",
    "{% with a = 1, b = n %}{{ a + b }}{% endwith %}{% filter upper %}shout {{ s }}{% endfilter %}",
    "{{ msgs[0].content }} {{ msgs[1]['name'] }} {{ msgs[2].content is none }} {{ msgs[0].missing is defined }} {{ msgs.0.role }}",
    "{% set parts = s.split(',') %}{{ parts[0] | trim }}/{{ parts[1] | trim }}/{{ parts | length }}{% set s2 = s.strip() %}{{ s2[:5] }}",
    "{% for m in msgs %}{% set role = m['role'] %}{% if role == 'user' %}U{% elif role == 'assistant' %}A{% else %}O{% endif %}{{ loop.index0 }}{% endfor %}",
    "{{ cjk | upper }} {{ cjk.split('，') }} {{ cjk | reverse }} {{ cjk[1:3] }} {{ cjk | tojson }} {{ cjk.startswith('你') }}",
    "{{ 10 / 4 }} {{ 10 // 4 }} {{ -10 // 4 }} {{ 10 % -3 }} {{ 7.5 // 2 }} {{ 7.5 % 2 }} {{ 2 ** -1 }} {{ 3 * 1.5 }} {{ 1 + True }}",
    "{{ [1, 'a', None, 1.5, [2], {'k': 'v'}] }} {{ {'x': 1, 'y': [True, False]} }} {{ 'it\\'s' }} {{ ['it\\'s', \"q\\\"\"] }}",
    "{%- for i in range(3) -%}\n  {{ i }}\n{%- endfor %}\n{% for i in range(2) %}\n  row {{ i }}\n{% endfor %}\ndone",
]


def _kestrel_render(tmp_path_factory, requests):
    d = tmp_path_factory.mktemp("tmpl")
    _tiny_tokenizer(d)
    return batch(d, requests)


def _tiny_tokenizer(d):
    """A byte-level tokenizer.json (no merges) so that `kestrel tokenize DIR` starts; rendering does not use it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    tj = {"added_tokens": [], "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
          "post_processor": None, "decoder": {"type": "ByteLevel"},
          "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    (d / "tokenizer.json").write_text(json.dumps(tj))


def test_snippets_match_jinja2(tmp_path_factory):
    reqs = [{"op": "render", "template": t, "context": CONTEXT} for t in SNIPPETS]
    got = _kestrel_render(tmp_path_factory, reqs)
    mism = []
    for t, g in zip(SNIPPETS, got):
        want = render_ref(t, CONTEXT)
        if g.get("text") != want:
            mism.append((t, g, want))
    report(mism, "snippet")


# ---------------------------------------------------------------------------------------------------------------
# Chat templates in the style of the published ones.

KIMI_STYLE = r"""
{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
        {{ c }}
    {%- elif c is not none -%}
        {%- for part in c -%}
            {%- if part['type'] == 'text' -%}{{ part['text'] }}{%- else -%}<|media_pad|>{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
    {%- endif -%}
    {%- set role_name = message.get('name') or message['role'] -%}
    {%- if message['role'] == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
    {%- elif message['role'] == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
    {%- elif message['role'] in ['system', 'tool'] -%}
<|im_system|>{{ role_name }}<|im_middle|>
    {%- else -%}
{{ raise_exception('unknown role: ' ~ message['role']) }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- if loop.index0 > ns.last_user and message.get('reasoning_content') -%}
<think>{{ message['reasoning_content'] | trim }}</think>
        {%- else -%}
<think></think>
        {%- endif -%}
        {{ render_content(message) }}
        {%- if message.get('tool_calls') -%}
<|tool_calls_section_begin|>
            {%- for tool_call in message['tool_calls'] -%}
                {%- set args = tool_call['function']['arguments'] -%}
<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>{% if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif %}<|tool_call_end|>
            {%- endfor -%}
<|tool_calls_section_end|>
        {%- endif -%}
    {%- elif message['role'] == 'tool' -%}
## Return of {{ message.tool_call_id }}
{{ render_content(message) }}
    {%- else -%}
        {{ render_content(message) }}
    {%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
    {%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}
{%- endif -%}
"""

DEEPSEEK_STYLE = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}
            {% set ns.system_prompt = ns.system_prompt + message['content'] %}
            {% set ns.is_first_sp = false %}
        {%- else %}
            {% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{% if tools is not none and tools | length > 0 %}
{% set ns.system_prompt = ns.system_prompt + '\n\n## Tools\n' %}
{% for tool in tools %}
{% set ns.system_prompt = ns.system_prompt + '\n### ' + tool['function']['name'] + '\n' + (tool['function']['description'] | default('')) + '\nParameters: ' + (tool['function']['parameters'] | tojson) %}
{% endfor %}
{% endif %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.is_tool = false -%}
        {{ '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}
        {%- set ns.is_tool = false -%}
        {%- for tool in message['tool_calls'] %}
            {%- if not ns.is_first %}
                {%- if message['content'] is none %}
                    {{ '<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + (tool['function']['arguments'] if tool['function']['arguments'] is string else tool['function']['arguments'] | tojson) + '<｜tool▁call▁end｜>' }}
                {%- else %}
                    {{ '<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + (tool['function']['arguments'] if tool['function']['arguments'] is string else tool['function']['arguments'] | tojson) + '<｜tool▁call▁end｜>' }}
                {%- endif %}
                {%- set ns.is_first = true -%}
            {%- else %}
                {{ '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + (tool['function']['arguments'] if tool['function']['arguments'] is string else tool['function']['arguments'] | tojson) + '<｜tool▁call▁end｜>' }}
            {%- endif %}
        {%- endfor %}
        {{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if ns.is_tool %}
            {{ '<｜tool▁outputs▁end｜>' }}
            {%- set ns.is_tool = false -%}
        {%- endif %}
        {%- set content = message['content'] if message['content'] is not none else '' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'tool' %}
        {%- set ns.is_tool = true -%}
        {%- if ns.is_output_first %}
            {{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + (message['content'] | string) + '<｜tool▁output▁end｜>' }}
            {%- set ns.is_output_first = false %}
        {%- else %}
            {{ '<｜tool▁output▁begin｜>' + (message['content'] | string) + '<｜tool▁output▁end｜>' }}
        {%- endif %}
    {%- endif %}
{%- endfor -%}
{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}
{% if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city, in °C.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "城市"},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1},
                                          "detail": {"type": "number", "multipleOf": 0.5},
                                          "units": {"enum": ["c", "f", None]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}}},
]


_POOL = text_corpus.strings(400, seed=21)


def _content(r):
    pool = _POOL
    k = r.random()
    if k < 0.1:
        return "Use {{ braces }} and {% tags %} literally: <|im_end|> </think>"
    if k < 0.2:
        return "a\n\n  indented\n\tand tabbed  "
    return r.choice(pool)


def _conversations(n=160, seed=3):
    r = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        if r.random() < 0.6:
            msgs.append({"role": "system", "content": _content(r)})
        for turn in range(r.randint(1, 4)):
            msgs.append({"role": "user", "content": _content(r)})
            if r.random() < 0.4:
                call_id = f"functions.get_weather:{turn}"
                args = {"city": _content(r)[:20], "days": r.randint(1, 7), "detail": r.choice([0.5, 1.0, 2.25])}
                msgs.append({"role": "assistant", "content": r.choice([None, "", "Let me check."]),
                             "tool_calls": [{"id": call_id, "type": "function", "function": {
                                 "name": "get_weather",
                                 "arguments": json.dumps(args, ensure_ascii=False) if r.random() < 0.5 else args}}]})
                msgs.append({"role": "tool", "tool_call_id": call_id, "content": _content(r)})
            final = {"role": "assistant", "content": _content(r)}
            if r.random() < 0.5:
                final["reasoning_content"] = "  thinking about " + _content(r) + "  "
            if r.random() < 0.2:
                final["content"] = "<think>hidden</think>" + final["content"]
            if r.random() < 0.1:
                final["name"] = "kimi"
            msgs.append(final)
        if r.random() < 0.3:
            msgs.append({"role": "user", "content": [{"type": "text", "text": _content(r)}, {"type": "image"}]
                         if r.random() < 0.5 else _content(r)})
        out.append({"messages": msgs, "tools": TOOLS if r.random() < 0.4 else None,
                    "add_generation_prompt": r.random() < 0.7, "thinking": r.random() < 0.5})
    return out


def _hf_context(conv, config):
    ctx = {"messages": conv["messages"], "tools": conv["tools"], "documents": None,
           "add_generation_prompt": conv["add_generation_prompt"], "thinking": conv["thinking"]}
    ctx.update({k: v for k, v in config.items() if k.endswith("_token")})
    return ctx


@pytest.mark.parametrize("name", ["kimi_style", "deepseek_style"])
def test_chat_templates_match_jinja2(name, tmp_path_factory):
    template = {"kimi_style": KIMI_STYLE, "deepseek_style": DEEPSEEK_STYLE}[name]
    config = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "chat_template": template}
    d = tmp_path_factory.mktemp(name)
    _tiny_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    convs = _conversations()
    if name == "deepseek_style":  # this template has no multi-part content
        convs = [c for c in convs if all(isinstance(m["content"], (str, type(None))) for m in c["messages"])]
    reqs = [{"op": "chat", "messages": c["messages"], "tools": c["tools"],
             "add_generation_prompt": c["add_generation_prompt"], "extra": {"thinking": c["thinking"]}}
            for c in convs]
    got = batch(d, reqs)
    mism = []
    compiled = _env().from_string(template)
    for c, g in zip(convs, got):
        want = compiled.render(**_hf_context(c, config))
        if g.get("text") != want:
            mism.append((c["messages"][:2], g, want))
    report(mism, f"{name} chat template")
    assert len(convs) >= 100


def test_make_model_template_matches_jinja2(tmp_path):
    import subprocess
    d = tmp_path / "tiny"
    res = subprocess.run([kestrel_bin(), "make-model", "--preset", "tiny", "--arch", "kimi_k3", "--out", str(d)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.fail(f"make-model failed: {res.stderr}")
    config = json.loads((d / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    convs = [c for c in _conversations(120, seed=8)
             if all(isinstance(m["content"], (str, type(None))) for m in c["messages"])]
    reqs = [{"op": "chat", "messages": c["messages"], "tools": c["tools"],
             "add_generation_prompt": c["add_generation_prompt"]} for c in convs]
    got = batch(d, reqs)
    compiled = _env().from_string(template)
    mism = []
    for c, g in zip(convs, got):
        want = compiled.render(messages=c["messages"], tools=c["tools"], documents=None,
                                                add_generation_prompt=c["add_generation_prompt"],
                                                **{k: v for k, v in config.items() if k.endswith("_token")})
        if g.get("text") != want:
            mism.append((c["messages"][:2], g, want))
    report(mism, "make-model chat template")


ERROR_TEMPLATES = [
    ("{{ raise_exception('bad role') }}", "bad role"),
    ("{% for m in messages %}{% if m.role == 'x' %}{{ raise_exception('role x is not allowed') }}{% endif %}{% endfor %}",
     "role x is not allowed"),
    ("{% frobnicate %}", "frobnicate"),
    ("{{ x | no_such_filter }}", "no_such_filter"),
    ("{% if true %}unclosed", "endif"),
    ("{{ 'a' + 1 }}", ""),
    ("{{ undefined_fn() }}", ""),
    ("{{ 1 / 0 }}", ""),
    ("{% for x in none %}{% endfor %}", ""),
]


def test_errors_are_reported(tmp_path_factory):
    ctx = {"messages": [{"role": "x"}]}
    reqs = [{"op": "render", "template": t, "context": ctx} for t, _ in ERROR_TEMPLATES]
    got = _kestrel_render(tmp_path_factory, reqs)
    mism = []
    for (t, needle), g in zip(ERROR_TEMPLATES, got):
        with pytest.raises(Exception):
            render_ref(t, {**ctx, "none": None})
        if "error" not in g or needle not in g["error"]:
            mism.append((t, g))
    report(mism, "template error")
