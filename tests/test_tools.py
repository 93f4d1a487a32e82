"""Tool calling (deployments/tools.py): tools validated and shown to templates with and without a
place for them, forced calls constrained to the tools' schemas (a random model's output still
parses into valid calls, the same with speculation as without), calls read back from the text,
and the OpenAI shapes of calls in responses and stream deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import save_perturbed_copy, save_tiny_model
from test_serve_grpc import save_char_tokenizer

from deployments.tools import (
    ToolError,
    call_grammar,
    check_choice,
    parse_calls,
    parse_tools,
    template_takes_tools,
    with_tools,
)
from engine import LLM, SamplingParams, SpeculativeConfig, StructuredOutput
from protos.specdecode.v1 import specdecode_pb2 as pb

WEATHER = ("get_weather", "Weather in a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}))
TIME = ("get_time", "Time in a zone", json.dumps({
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}))


def test_tools_are_validated_with_the_field_named():
    tools = parse_tools([WEATHER, TIME])
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    for bad, match in [([("bad name", "", "")], r"tools\[0\].name"), ([WEATHER, WEATHER], "given twice"),
                       ([("f", "", "[1]")], "JSON Schema object"), ([("f", "", "{")], "not JSON")]:
        with pytest.raises(ToolError, match=match):
            parse_tools(bad)
    check_choice("get_time", tools)
    with pytest.raises(ToolError, match="not one of the tools"):
        check_choice("get_date", tools)
    with pytest.raises(ToolError, match="no tools"):
        check_choice("required", [])


def test_calls_are_read_back_from_the_text():
    tools = parse_tools([WEATHER, TIME])
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
            '<tool_call>{"name":"get_time","arguments":{"zone":1}}</tool_call>')
    content, calls = parse_calls(text, tools)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"} and calls[0].id.startswith("call_")
    for junk in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>", "plain"):
        assert parse_calls(junk, tools) == (junk, [])


def test_a_template_without_tools_gets_them_in_a_system_message():
    tools = parse_tools([WEATHER])
    assert template_takes_tools("{% if tools %}...{% endif %}") and not template_takes_tools("{{ messages }}")
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "a"}'}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    shown = with_tools(history, tools, takes_tools=False)
    assert shown[0]["role"] == "system" and "get_weather" in shown[0]["content"] and "<tool_call>" in shown[0]["content"]
    assert shown[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "a"}}</tool_call>'
    templated = with_tools(history, tools, takes_tools=True)
    assert templated[1]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "a"}}}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tools")
    target = save_tiny_model(str(root / "target"), "llama")
    save_char_tokenizer(target)
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    return {"target": target, "drafter": drafter}


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_forced_call_is_valid_for_its_tool_with_and_without_speculation(models, choice):
    tools = parse_tools([WEATHER, TIME])
    params = SamplingParams(max_tokens=200, temperature=0.0,
                            structured_output=StructuredOutput("grammar", call_grammar(tools, choice)))
    outs = {}
    for method in (None, "draft"):
        spec = None if method is None else SpeculativeConfig(method="draft", model=models["drafter"],
                                                             num_speculative_tokens=4, adaptive=False)
        llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec, kv_cache_memory_bytes=1 << 22)
        (out,) = llm.generate(["call: "], params)
        assert out.finish_reason == "stop", out.text
        content, calls = parse_calls(out.text, tools)
        assert content == "" and calls
        for call in calls:
            tool = next(t for t in tools if t.name == call.name)
            jsonschema.validate(json.loads(call.arguments), tool.parameters)
        if choice != "required":
            assert [c.name for c in calls] == [choice]
        outs[method] = out.token_ids
    assert outs[None] == outs["draft"]


def test_openai_shapes_of_calls_whole_and_streamed():
    from deployments.openai_api import ResponseBuilder

    last = pb.GenerateResponse(text='"}}</tool_call>', finish_reason=pb.FINISH_REASON_TOOL_CALLS)
    last.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=9))
    last.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "a"}')
    messages = [pb.GenerateResponse(text='<tool_call>{"name":"get_weather","arguments":{"city":"a'), last]
    whole = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, calling=True).whole(messages)
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": '{"city": "a"}'}}]
    builder = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, calling=True)
    assert builder.chunk(messages[0]) is None  # held: it may be a call
    delta = builder.chunk(last)["choices"][0]["delta"]
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = pb.GenerateResponse(text="just text", finish_reason=pb.FINISH_REASON_STOP)
    plain.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=2))
    text_only = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, calling=True)
    assert text_only.chunk(plain)["choices"][0]["delta"]["content"] == "just text"
