"""The official `openai` SDK against `kestrel serve` on the tiny kimi_k3 models: completions, chat, streaming with
usage, n > 1, logprobs, stop strings, seeds, tools and reasoning (on the scripted model, whose greedy output is
known), /v1/models, tokenize/detokenize, and raw server-sent events through curl."""

import json
import math
import shutil
import subprocess

import pytest

import test_server_harness as h
from test_server_harness import scripted_dir, tiny_dir  # noqa: F401 (fixtures)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tiny_dir):  # noqa: F811
    s = h.Server(tiny_dir, "--seed", 1)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def scripted(scripted_dir):  # noqa: F811
    s = h.Server(scripted_dir, "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser",
                 "kimi_k3", name="scripted")
    yield s
    assert s.stop() == 0


def token_ids(logprobs_content):
    return [int(t.token.split(":")[1]) for t in logprobs_content]


def test_models(tiny):
    models = tiny.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == 4096


def test_completion_scripted_text_and_usage(scripted):
    r = scripted.client().completions.create(model="scripted", prompt="Z", max_tokens=20)
    c = r.choices[0]
    assert c.text == h.SCRIPTED_COMPLETION
    assert c.finish_reason == "stop"
    # One token per piece plus the end-of-turn token, which ends the completion and has no text.
    assert r.usage.prompt_tokens == 1
    assert r.usage.completion_tokens == len(h.COMPLETION_PIECES) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_length_and_echo(scripted):
    r = scripted.client().completions.create(model="scripted", prompt="Z", max_tokens=3, echo=True)
    assert r.choices[0].text == "Z" + "".join(h.COMPLETION_PIECES[:3])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_chat_random_model_counts_tokens(tiny):
    r = tiny.client().chat.completions.create(model="tiny", messages=USER, max_tokens=7,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 7
    prompt = h.post(tiny.url + "/tokenize", {"messages": USER})[1]
    assert r.usage.prompt_tokens == prompt["count"]


def test_stream_matches_non_stream_with_usage(tiny):
    kw = dict(model="tiny", messages=USER, max_tokens=12, temperature=0.8, seed=5,
              extra_body={"ignore_eos": True, "skip_special_tokens": False})
    whole = tiny.client().chat.completions.create(**kw)
    chunks = list(tiny.client().chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_completions_differ_and_count(tiny):
    r = tiny.client().completions.create(model="tiny", prompt="abc", n=3, max_tokens=6, temperature=1.0, seed=11,
                                         logprobs=0, extra_body={"ignore_eos": True,
                                                                 "return_tokens_as_token_ids": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    seqs = [tuple(c.logprobs.tokens) for c in r.choices]
    assert len(set(seqs)) > 1  # each completion draws from its own stream


def test_logprobs_greedy_top_alternatives(tiny):
    r = tiny.client().chat.completions.create(model="tiny", messages=USER, max_tokens=5, logprobs=True,
                                              top_logprobs=3, extra_body={"ignore_eos": True,
                                                                          "return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    total = 0.0
    for t in content:
        tops = t.top_logprobs
        assert len(tops) == 3
        assert all(a.logprob >= b.logprob for a, b in zip(tops, tops[1:]))
        # Greedy picks the most likely token (ties to the lower id), so it is the first alternative.
        assert t.token == tops[0].token and t.logprob == tops[0].logprob
        assert t.logprob <= 0 and math.isfinite(t.logprob)
        total += math.exp(tops[0].logprob) + math.exp(tops[1].logprob) + math.exp(tops[2].logprob)
    assert total <= 5 * (1 + 1e-5)


def test_stop_strings(scripted):
    c = scripted.client()
    r = c.completions.create(model="scripted", prompt="Z", max_tokens=20, stop=[" this", "zzz"])
    assert r.choices[0].text == "Hello world,"
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == " this"
    r = c.completions.create(model="scripted", prompt="Z", max_tokens=20, stop="kes",
                             extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "Hello world, this is kes"
    # A stop string split across tokens, streamed: the text before it arrives, nothing after.
    parts = [ch.choices[0].text for ch in c.completions.create(model="scripted", prompt="Z", max_tokens=20,
                                                                stop="d, th", stream=True)]
    assert "".join(parts) == "Hello worl"


def test_stop_token_ids(scripted):
    world = h.post(scripted.url + "/tokenize", {"prompt": " world"})[1]["tokens"]
    assert len(world) == 1
    r = scripted.client().completions.create(model="scripted", prompt="Z", max_tokens=20,
                                             extra_body={"stop_token_ids": world})
    assert r.choices[0].text == "Hello"
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == world[0]


def test_seed_reproducibility(tiny):
    def run(seed):
        r = tiny.client().completions.create(model="tiny", prompt="The sea", max_tokens=16, temperature=1.0,
                                             seed=seed, logprobs=0,
                                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return r.choices[0].logprobs.tokens
    a, b, c = run(1234), run(1234), run(4321)
    assert a == b
    assert a != c


def test_tool_call_and_reasoning(scripted):
    r = scripted.client().chat.completions.create(model="scripted", messages=USER, tools=TOOLS)
    m = r.choices[0].message
    assert m.reasoning_content == h.REASONING
    assert m.content == h.CONTENT
    assert len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert call.id == h.CALL_ID and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_tool_call_streamed_equals_whole(scripted):
    kw = dict(model="scripted", messages=USER, tools=TOOLS)
    whole = scripted.client().chat.completions.create(**kw).choices[0].message
    reasoning, content, calls, finish = "", "", {}, None
    for ch in scripted.client().chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        reasoning += d.model_extra.get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id:
                entry["id"], entry["name"] = t.id, t.function.name
            entry["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert reasoning == whole.reasoning_content and content == whole.content
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.id, t.function.name, t.function.arguments) for t in whole.tool_calls]
    assert finish == "tool_calls"


def test_named_tool_choice_forces_the_call(scripted):
    r = scripted.client().chat.completions.create(
        model="scripted", messages=USER, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert [t.function.name for t in m.tool_calls] == ["get_weather"]
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert not m.content


@pytest.fixture(scope="module")
def scripted_dsml(tmp_path_factory):
    d = h.make_scripted(tmp_path_factory.mktemp("scripted_dsml"), turn=h.DSML_TURN)
    s = h.Server(d, "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v32", "--reasoning-parser",
                 "deepseek_v32", name="scripted")
    yield s
    assert s.stop() == 0


def test_deepseek_v32_parsers_streamed_and_whole(scripted_dsml):
    kw = dict(model="scripted", messages=USER, tools=TOOLS)
    whole = scripted_dsml.client().chat.completions.create(**kw)
    m = whole.choices[0].message
    assert m.reasoning_content == h.REASONING and m.content == h.CONTENT
    assert [t.function.name for t in m.tool_calls] == ["get_weather"]
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert whole.choices[0].finish_reason == "tool_calls"
    names, args, content = [], "", ""
    for ch in scripted_dsml.client().chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.function.name:
                names.append(t.function.name)
                assert t.id.startswith("call_") and m.tool_calls[0].id.startswith("call_")
            args += t.function.arguments or ""
    assert names == ["get_weather"] and args == m.tool_calls[0].function.arguments and content == h.CONTENT


def test_tool_choice_none_keeps_markup_out_of_calls(scripted):
    r = scripted.client().chat.completions.create(model="scripted", messages=USER, tools=TOOLS, tool_choice="none")
    m = r.choices[0].message
    assert not m.tool_calls
    assert m.reasoning_content == h.REASONING
    assert "<|tool_call_begin|>" in m.content and h.ARGUMENTS in m.content


def test_multi_turn_with_reasoning_and_tool_results(scripted):
    first = scripted.client().chat.completions.create(model="scripted", messages=USER, tools=TOOLS).choices[0]
    call = first.message.tool_calls[0]
    history = USER + [
        {"role": "assistant", "content": first.message.content, "reasoning_content": first.message.reasoning_content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        {"role": "user", "content": "Thanks"},
    ]
    r = scripted.client().chat.completions.create(model="scripted", messages=history, tools=TOOLS)
    assert r.choices[0].message.reasoning_content == h.REASONING
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tokenize_detokenize(tiny, tiny_dir):  # noqa: F811
    text = "Hi é, the sea! <|im_end|>"
    status, r = h.post(tiny.url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200
    assert r["tokens"] == h.tok_ids(tiny_dir, text)  # the reference `tokenizers` library on the same file
    assert r["tokens"][-1] == h.EOS  # special tokens written in the text are recognised
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    assert len(r["token_strs"]) == len(r["tokens"]) and r["token_strs"][0] == "Hi"[:len(r["token_strs"][0])]
    status, d = h.post(tiny.url + "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["prompt"] == text
    status, r = h.post(tiny.url + "/tokenize", {"messages": USER})
    assert r["tokens"][0] == 259 and r["tokens"][-1] == h.IM_MIDDLE  # <|im_user|> ... <|im_middle|>


def test_curl_streams_server_sent_events(tiny):
    curl = shutil.which("curl")
    if not curl:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 5, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True})
    out = subprocess.run([curl, "-sS", "-N", "-i", "-H", "Content-Type: application/json", "-d", body,
                          tiny.url + "/v1/chat/completions"], capture_output=True, timeout=60, check=True).stdout
    head, _, events = out.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert "content-type: text/event-stream" in head.lower()
    blocks = events.split("\n\n")
    assert blocks[-1] == ""
    blocks = blocks[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    assert blocks[-1] == "data: [DONE]"
    chunks = [json.loads(b[len("data: "):]) for b in blocks[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_health_and_version(tiny):
    assert tiny.get("/health")[0] == 200
    status, body = tiny.get("/version")
    assert status == 200 and json.loads(body)["version"]
