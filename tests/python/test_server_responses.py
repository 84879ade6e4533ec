"""/v1/responses driven by the official `openai` client (issue 21): plain, streamed, with a tool call and with
reasoning (the scripted checkpoint's known output), multi-turn input items, and the requests it refuses."""

import json

import pytest

import test_server_harness as h
from test_server_harness import scripted_dir, tiny_dir  # noqa: F401 (fixtures)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


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


def test_plain_response(tiny):
    r = tiny.client().responses.create(model="tiny", input="Hello there", max_output_tokens=6,
                                       instructions="Be brief.", extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text
    assert r.instructions == "Be brief."
    # The same request through chat gives the same text (greedy).
    chat = tiny.client().chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    greedy = tiny.client().responses.create(model="tiny", input="Hello there", max_output_tokens=6, temperature=0,
                                            instructions="Be brief.", extra_body={"ignore_eos": True})
    assert greedy.output_text == chat.choices[0].message.content


def test_streamed_equals_whole(tiny):
    kw = dict(model="tiny", input="Stream me", max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = tiny.client().responses.create(**kw)
    events = list(tiny.client().responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8


def test_reasoning_and_tool_call(scripted):
    r = scripted.client().responses.create(model="scripted", input="What is the weather in Paris?", tools=TOOLS)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == h.REASONING
    assert r.output_text == h.CONTENT
    call = r.output[2]
    assert call.name == "get_weather" and call.call_id == h.CALL_ID
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_reasoning_and_tool_call_streamed(scripted):
    events = list(scripted.client().responses.create(model="scripted", input="What is the weather in Paris?",
                                                     tools=TOOLS, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert reasoning == h.REASONING and content == h.CONTENT
    assert json.loads(args) == {"city": "Paris"}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    final = events[-1]
    assert final.type == "response.completed"
    assert [o.type for o in final.response.output] == ["reasoning", "message", "function_call"]
    assert final.response.output[2].call_id == h.CALL_ID


def test_multi_turn_items(scripted):
    # The earlier turn's reasoning, call and the call's output, as Responses input items.
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": h.REASONING}]},
             {"type": "function_call", "call_id": h.CALL_ID, "name": "get_weather", "arguments": h.ARGUMENTS},
             {"type": "function_call_output", "call_id": h.CALL_ID, "output": "Sunny, 21 C"},
             {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    r = scripted.client().responses.create(model="scripted", input=items, tools=TOOLS, max_output_tokens=40)
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 20


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0]"),
    ({"input": 5}, "input"),
], ids=["previous_response_id", "web_search tool", "image item", "input a number"])
def test_refused(tiny, extra, param):
    status, r = h.post(tiny.url + "/v1/responses", {"model": "tiny", "input": "x", **extra})
    assert status == 400, r
    assert r["error"]["param"] == param
