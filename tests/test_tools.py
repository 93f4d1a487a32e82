"""Tool calling (deployments/tools.py): tools validated and shown to templates with and without a
place for them, forced calls constrained to the tools' schemas (a random model's output still
parses into valid calls, the same with speculation as without), calls read back from the text,
and the OpenAI shapes of calls in responses and stream deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import save_perturbed_copy, save_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
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
    names = ["get_weather"]
    whole = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, tool_names=names).whole(messages)
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": '{"city": "a"}'}}]
    builder = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, tool_names=names)
    assert builder.chunk(messages[0]) is None  # held: an open call block
    end = builder.chunk(last)["choices"][0]
    assert end["finish_reason"] == "tool_calls" and "content" not in end["delta"]
    (call,) = end["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "a"}'}
    plain = pb.GenerateResponse(text="just text", finish_reason=pb.FINISH_REASON_STOP)
    plain.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=2))
    text_only = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, tool_names=names)
    assert text_only.chunk(plain)["choices"][0]["delta"]["content"] == "just text"


def test_auto_streams_text_as_it_comes_and_each_call_when_its_block_closes():
    """With tools offered the text before a call is not held to the end: it streams, short of a
    tail that may begin a call block; a call goes out once its block closes."""
    from deployments.openai_api import ResponseBuilder

    builder = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, tool_names=["get_time"])
    pieces = ["Let me ", "check the time.\n<tool", '_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>',
              "\n<tool_call>", '{"name": "get_time", "arguments": {"zone": 2}}</tool_call>', " Done"]
    deltas = [builder.chunk(pb.GenerateResponse(text=p)) for p in pieces]
    # whitespace that may precede a call is held: "Let me" now, the space with what follows
    assert deltas[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Let me"}
    assert deltas[1]["choices"][0]["delta"] == {"content": " check the time."}  # "\n<tool" held
    first = deltas[2]["choices"][0]["delta"]
    assert "content" not in first and first["tool_calls"][0]["index"] == 0
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"zone": 1}
    assert deltas[3] is None
    assert deltas[4]["choices"][0]["delta"]["tool_calls"][0]["index"] == 1
    assert deltas[5]["choices"][0]["delta"] == {"content": "Done"}  # the space after a call dropped


@st.composite
def call_texts(draw) -> list[str]:
    """A model's text with tools offered, cut into stream pieces: prose, whitespace, calls of
    known tools, blocks that are not calls (unknown name, bad JSON, unclosed) and near misses."""
    parts = draw(st.lists(st.one_of(
        st.text(alphabet="ab <>/_\n", max_size=6),
        st.sampled_from([" ", "\n", "<", "<tool", "<tool_call", "</tool_call>", "tool_call>"]),
        st.builds(lambda z: f'<tool_call>{{"name": "get_time", "arguments": {{"zone": {z}}}}}</tool_call>',
                  st.integers(-12, 14)),
        st.just('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
        st.just("<tool_call>{not json</tool_call>"),
        st.just('<tool_call>{"name": "get_time"'),
    ), max_size=8))
    text = "".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(call_texts())
def test_streamed_content_and_calls_equal_the_whole_texts(pieces):
    """However the text is cut, the content streamed is the whole text's content (parse_calls)
    and the calls streamed are its calls, in order."""
    from deployments.tools import CallStream

    tools = parse_tools([TIME])
    content, calls = parse_calls("".join(pieces), tools)
    stream = CallStream({"get_time"})
    streamed, streamed_calls = [], []
    for piece in pieces:
        text, got = stream.feed(piece)
        streamed.append(text)
        streamed_calls += got
    text, got = stream.finish()
    streamed.append(text)
    streamed_calls += got
    assert "".join(streamed) == content
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]
    if not calls:
        assert content == "".join(pieces)
