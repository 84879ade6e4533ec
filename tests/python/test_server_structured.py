"""Structured output through the official `openai` SDK against `kestrel serve` on the tiny kimi_k3 models:
response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields, tool_choice "required"
and named tools, with thinking on (the scripted model writes <think>...</think> first) and off (a random model, its
prompt closing the reasoning section), streamed and not. Every completion that ends must be valid (jsonschema),
and bad schemas and grammars get a 400 naming the field."""

import json
import re

import jsonschema
import pytest

import test_server_harness as h
from test_server_harness import scripted_dir, tiny_dir  # noqa: F401 (fixtures)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "tense"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "mood"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
USER = [{"role": "user", "content": "Tell me about someone."}]
# The chat template renders the assistant's content; continuing it leaves a prompt that closed the reasoning
# section: thinking off.
NO_THINKING = USER + [{"role": "assistant", "content": "<think></think>"}]
NO_THINKING_KW = dict(messages=NO_THINKING, extra_body={"continue_final_message": True, "add_generation_prompt": False})


@pytest.fixture(scope="module")
def tiny(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--seed", 3, "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3",
                 "--reasoning-parser", "kimi_k3")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def scripted(scripted_dir):  # noqa: F811
    s = h.Server(scripted_dir, "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser",
                 "kimi_k3", name="scripted")
    yield s
    assert s.stop() == 0


def stream_chat(client, **kw):
    content, reasoning, calls, finish = "", "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"name": None, "arguments": ""})
            if t.function.name:
                e["name"] = t.function.name
            e["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, [(c["name"], c["arguments"]) for c in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_without_thinking_is_always_valid(tiny, stream):
    client = tiny.client()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        kw = dict(model="tiny", max_tokens=400, temperature=1.0, seed=seed, response_format=rf, **NO_THINKING_KW)
        if stream:
            content, reasoning, _, finish = stream_chat(client, **kw)
        else:
            r = client.chat.completions.create(**kw)
            content, reasoning, finish = r.choices[0].message.content, r.choices[0].message.reasoning_content, \
                r.choices[0].finish_reason
        assert finish == "stop", (seed, content)
        assert not reasoning
        jsonschema.validate(json.loads(content), SCHEMA)


def test_streamed_equals_whole(tiny):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kw = dict(model="tiny", max_tokens=400, temperature=0.8, seed=11, response_format=rf, **NO_THINKING_KW)
    whole = tiny.client().chat.completions.create(**kw).choices[0].message.content
    content, _, _, _ = stream_chat(tiny.client(), **kw)
    assert content == whole


def test_json_object_and_compact_whitespace(tiny):
    for seed in range(3):
        r = tiny.client().chat.completions.create(
            model="tiny", max_tokens=300, temperature=1.0, seed=seed, response_format={"type": "json_object"},
            **NO_THINKING_KW)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # a free object may run past max_tokens; what came must be a prefix of one
            assert r.choices[0].message.content.startswith("{")
    body = {**NO_THINKING_KW["extra_body"], "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    r = tiny.client().chat.completions.create(model="tiny", messages=NO_THINKING, max_tokens=300, temperature=1.0,
                                              seed=4, extra_body=body)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "\n" not in text and not re.search(r"[{\[,:] {2}|\s[}\]]", text)


def test_vllm_guided_fields_on_completions(tiny):
    client = tiny.client()
    cases = [
        ({"guided_regex": r"[a-c]{2,5}-\d\d"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d\d", t)),
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"guided_grammar": 'root ::= "(" [xy]+ ")" | "none"'}, lambda t: re.fullmatch(r"\([xy]+\)|none", t)),
        ({"structured_outputs": {"regex": r"\d{3}"}}, lambda t: re.fullmatch(r"\d{3}", t)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
          "guided_decoding_backend": "xgrammar"},
         lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "boolean"},
                                                       "minItems": 1, "maxItems": 3}) is None),
    ]
    for extra, ok in cases:
        for seed in range(3):
            r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, temperature=1.0, seed=seed,
                                          extra_body=extra)
            assert r.choices[0].finish_reason == "stop", (extra, r.choices[0].text)
            assert ok(r.choices[0].text), (extra, r.choices[0].text)


def test_tool_choice_required_and_named_without_thinking(tiny):
    client = tiny.client()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", tools=TOOLS, tool_choice="required", max_tokens=300,
                                           temperature=1.0, seed=seed, **NO_THINKING_KW)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", m
        assert m.tool_calls
        for c in m.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
        named = client.chat.completions.create(
            model="tiny", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=200, temperature=1.0, seed=seed, **NO_THINKING_KW)
        calls = named.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0].function.arguments), params["get_time"])
    # parallel_tool_calls false: exactly one call.
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", tools=TOOLS, tool_choice="required", max_tokens=300,
                                           temperature=1.0, seed=seed, parallel_tool_calls=False, **NO_THINKING_KW)
        assert len(r.choices[0].message.tool_calls) == 1


def test_constraints_start_after_the_reasoning_section(scripted):
    """The scripted model thinks first (<think> REASONING </think>): the grammar applies only after it, so the
    reasoning is the model's own and the answer follows the schema, streamed or not."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kw = dict(model="scripted", messages=USER, max_tokens=60,
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    r = scripted.client().chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.reasoning_content == h.REASONING
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(m.content) == {"ok": True} or json.loads(m.content) == {"ok": False}
    content, reasoning, _, finish = stream_chat(scripted.client(), **kw)
    assert (content, reasoning, finish) == (m.content, m.reasoning_content, "stop")


def test_forced_tool_calls_after_the_reasoning_section(scripted):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        kw = dict(model="scripted", messages=USER, tools=tools, tool_choice=choice, max_tokens=60)
        r = scripted.client().chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.reasoning_content == h.REASONING
        assert not m.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        assert r.choices[0].finish_reason == "tool_calls"
        _, reasoning, calls, finish = stream_chat(scripted.client(), **kw)
        assert reasoning == h.REASONING and finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]


BAD = [
    ("malformed schema json", {"guided_json": "{not json"}, "guided_json"),
    ("unsupported keyword", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "multipleOf": 3}}}}, "response_format"),
    ("schema type", {"structured_outputs": {"json": {"type": "tuple"}}}, "structured_outputs"),
    ("bad regex", {"guided_regex": "(ab"}, "guided_regex"),
    ("back-reference", {"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs"),
    ("bad grammar", {"guided_grammar": "root ::= (\"a\""}, "guided_grammar"),
    ("left recursion", {"guided_grammar": "root ::= root \"a\" | \"b\""}, "guided_grammar"),
    ("empty language", {"guided_grammar": "root ::= [^\\x00-\\U0010FFFF]"}, "guided_grammar"),
    ("xgrammar macro", {"guided_grammar": "root ::= Regex(\"[a-z]+\")"}, "guided_grammar"),
    ("rule attributes", {"guided_grammar": "root ::= a\na[max_chars=3] ::= [a-z]*"}, "guided_grammar"),
    ("enum of no listed type", {"guided_json": {"type": "string", "enum": [1, 2]}}, "guided_json"),
    ("two constraints", {"guided_regex": "a", "guided_choice": ["b"]}, None),
    ("empty choice", {"guided_choice": []}, "guided_choice"),
    ("unknown backend", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("whitespace pattern", {"structured_outputs": {"json": {}, "whitespace_pattern": " *"}}, None),
    ("structural tag", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("too large", {"structured_outputs": {"regex": "[ab]*a[ab]{40}"}}, "structured_outputs"),
]


@pytest.mark.parametrize("what,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_are_a_precise_400(tiny, what, extra, param):
    status, body = h.post(tiny.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra})
    assert status == 400, body
    if param:
        assert body["error"]["param"] == param, body
    assert body["error"]["message"]
    if what == "empty language":
        assert "matches no string" in body["error"]["message"], body
    if what == "rule attributes":
        assert "rule attributes ('a[...] ::='" in body["error"]["message"], body
    if what == "xgrammar macro":
        assert "built-in 'Regex(...)' is not supported" in body["error"]["message"], body
    status, body = h.post(tiny.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert status == 200, body


def test_tool_choice_with_response_format_is_refused(tiny):
    status, body = h.post(tiny.url + "/v1/chat/completions", {
        "model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert status == 400 and body["error"]["param"] == "response_format", body
