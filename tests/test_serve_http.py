"""The OpenAI-compatible HTTP API end to end: the official `openai` client against a real Ray Serve
(HTTP proxy and gRPC proxy on loopback, one app) with a tiny random model that speculates with
n-gram lookup and has a character tokenizer with a chat template.

Greedy output over HTTP must equal the gRPC path's for the same request (both go through the
same ingress and replica code), chat must equal a completion of the template-rendered prompt,
errors must arrive as the client library's exceptions with OpenAI-style bodies, a client that
hangs up mid-stream must leave no KV blocks held, and the caller's `traceparent` header must
parent the replica's request span.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deployments.client import SpecDecodeClient
from protos.specdecode.v1 import specdecode_pb2 as pb

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

APP = "specdecode-http"
MAX_NUM_SEQS = 4
LONG = 4000  # output tokens of a request that is still running when the client hangs up
ABORT_WAIT_S = 3.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
GREEDY = dict(max_tokens=24, temperature=0.0)
IGNORE_EOS = {"specdecode": {"ignore_eos": True, "return_token_ids": True}}


@dataclass
class Served:
    http_base: str
    grpc_target: str
    model: str
    spans_file: Path

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http_base}/v1", api_key="unused", max_retries=0,
                             timeout=kwargs.pop("timeout", 60), **kwargs)

    def grpc(self) -> SpecDecodeClient:
        return SpecDecodeClient(self.grpc_target, application=APP, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory, serve_instance) -> Iterator[Served]:
    from helpers import save_tiny_model
    from ray import serve
    from test_serve_grpc import save_char_tokenizer
    from transformers import AutoTokenizer

    from deployments.app import build_app

    model = save_tiny_model(str(tmp_path_factory.mktemp("http_model")), "llama", max_position_embeddings=4096)
    save_char_tokenizer(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    spans_file = tmp_path_factory.mktemp("http_traces") / "spans.jsonl"
    args = {
        "model": model, "device": "cpu", "dtype": "float32", "num_cpus": 1, "max_num_seqs": MAX_NUM_SEQS,
        "max_queued_requests": 2, "max_prompt_tokens": 64, "max_tokens": LONG, "default_max_tokens": 16,
        "speculative": {"method": "ngram", "model": None, "num_speculative_tokens": 4, "adaptive": False},
        "tracing": {"exporter": "file", "file": str(spans_file)},
    }
    grpc_port, http_port = serve_instance.grpc_port, serve_instance.http_port
    with serve_instance.apps(APP):  # the shared Serve exports spans within 0.1 s (conftest)
        serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
        served = Served(f"http://127.0.0.1:{http_port}/{APP}", f"127.0.0.1:{grpc_port}", model, spans_file)
        with served.grpc() as client:
            client.wait_ready(60)
        yield served


def grpc_greedy(served: Served, prompt, max_tokens: int = 24, **kwargs) -> tuple[list[int], str, pb.GenerateResponse]:
    with served.grpc() as client:
        chunks = list(client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def wait_idle(served: Served, timeout: float) -> pb.EngineUsage:
    """Poll the replica (over gRPC) until it holds no request and no KV block, or time out."""
    deadline = time.monotonic() + timeout
    with served.grpc() as client:
        while True:
            usage = client.model_info().usage
            if (usage.num_running, usage.num_waiting, usage.num_used_blocks) == (0, 0, 0):
                return usage
            if time.monotonic() > deadline:
                return usage
            time.sleep(0.05)


# --- completions and chat --------------------------------------------------------------------------
def test_completions_equal_the_grpc_path(served: Served) -> None:
    client = served.openai()
    for prompt in ("def fib(n):", [5, 17, 33, 8, 40, 41]):
        ids, text, last = grpc_greedy(served, prompt)
        out = client.completions.create(model=served.model, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
        (choice,) = out.choices
        assert choice.text == text and choice.model_extra["token_ids"] == ids and len(ids) == 24
        assert choice.finish_reason == "length" and out.object == "text_completion"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (last.usage.prompt_tokens, 24)
        assert out.usage.total_tokens == last.usage.prompt_tokens + 24
        stats = out.model_extra["specdecode"]["speculation"]
        assert stats["enabled"] and stats["num_draft_tokens"] > 0

        chunks = list(client.completions.create(model=served.model, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                                **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == ids
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
        assert finishing[0].model_extra["specdecode"]["speculation"]["num_draft_tokens"] > 0
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24  # include_usage


def test_chat_renders_the_template_and_streams(served: Served) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    rendered = AutoTokenizer.from_pretrained(served.model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "system: be brief\nuser: def f\nassistant: "
    _, text, last = grpc_greedy(served, rendered, speculation="off")
    client = served.openai()
    ext = {"specdecode": {"ignore_eos": True, "speculation": "off"}}
    out = client.chat.completions.create(model=served.model, messages=messages, max_completion_tokens=24,
                                         temperature=0.0, extra_body=ext)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
    assert out.usage.prompt_tokens == last.usage.prompt_tokens == len(rendered)  # one token per character
    assert out.model_extra["specdecode"]["speculation"]["enabled"] is False
    chunks = list(client.chat.completions.create(model=served.model, messages=messages, max_tokens=24,
                                                 temperature=0.0, stream=True, extra_body=ext))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    # the gRPC API's chat: the same template on the server, the same answer
    chat_ids, chat_text, chat_last = grpc_greedy(served, messages, speculation="off")
    assert chat_text == text and chat_last.usage.prompt_tokens == len(rendered)
    with served.grpc() as client:
        streamed = "".join(c.text for c in client.chat(messages, max_tokens=24, temperature=0.0, ignore_eos=True))
        assert client.model_info().has_chat_template
    assert streamed == text


def test_structured_output_with_the_openai_client(served: Served) -> None:
    """response_format json_schema (strict) and json_object, streamed and not, our regex
    extension, and the gRPC field: every output matches, and greedy output with speculation
    equals it without; a bad format or schema is a 400 naming it."""
    import jsonschema
    import openai

    client = served.openai()
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["abc", "cab"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "abcabcabc"}]
    texts = {}
    for mode in ("on", "off"):
        out = client.chat.completions.create(model=served.model, messages=messages, max_tokens=80, temperature=0.0,
                                             response_format=fmt, extra_body={"specdecode": {"speculation": mode}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        texts[mode] = out.choices[0].message.content
    assert texts["on"] == texts["off"]
    chunks = client.chat.completions.create(model=served.model, messages=messages, max_tokens=80, temperature=0.0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["on"]
    anything = client.completions.create(model=served.model, prompt="abc", max_tokens=200, temperature=0.0,
                                         extra_body={"response_format": {"type": "json_object"}})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    regex = client.completions.create(model=served.model, prompt="abc", max_tokens=20, temperature=0.8, seed=3,
                                      extra_body={"specdecode": {"regex": "[ab]{3}-[0-9]{2}"}})
    assert __import__("re").fullmatch("[ab]{3}-[0-9]{2}", regex.choices[0].text)
    with served.grpc() as grpc_client:
        chunks = list(grpc_client.generate("abc", max_tokens=80, temperature=0.0, structured_output={"json_schema": schema}))
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model=served.model, prompt="abc", extra_body={"response_format": {"type": "xml"}})
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model=served.model, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}})


def test_the_openai_client_parses_structured_output_into_a_pydantic_model(served: Served) -> None:
    """`chat.completions.parse` and `chat.completions.stream` with a pydantic model as
    response_format (the client turns it into a strict json_schema and parses the answer back):
    the parsed object is the model's, streamed and not, and equals the raw content's."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Item(BaseModel):
        id: int = Field(ge=0, le=99)
        tag: Literal["abc", "cab"]

    client = served.openai()
    messages = [{"role": "user", "content": "abcabcabc"}]
    whole = client.chat.completions.parse(model=served.model, messages=messages, response_format=Item,
                                          max_tokens=80, temperature=0.0)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and isinstance(message.parsed, Item)
    assert message.parsed == Item.model_validate_json(message.content)
    with client.chat.completions.stream(model=served.model, messages=messages, response_format=Item, max_tokens=80,
                                        temperature=0.0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == message.parsed


def test_penalties_and_logit_bias_with_the_openai_client(served: Served) -> None:
    """presence/frequency penalties, logit_bias and our repetition_penalty/min_tokens change the
    output, equally with speculation on and off; the gRPC fields give the same tokens."""
    client = served.openai()
    prompt = "abcabcabcabcabcabc"
    fields = dict(presence_penalty=0.6, frequency_penalty=0.3, logit_bias={"5": 2.0})
    ext = {"repetition_penalty": 1.2, "min_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    texts = {}
    for mode in ("on", "off"):
        out = client.completions.create(model=served.model, prompt=prompt, **GREEDY, **fields,
                                        extra_body={"specdecode": {**ext, "speculation": mode}})
        texts[mode] = out.choices[0].text
    plain = client.completions.create(model=served.model, prompt=prompt, **GREEDY, extra_body=IGNORE_EOS)
    assert texts["on"] == texts["off"] != plain.choices[0].text
    with served.grpc() as grpc_client:
        chunks = list(grpc_client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.6,
                                           frequency_penalty=0.3, logit_bias={5: 2.0}, repetition_penalty=1.2,
                                           min_tokens=8))
    assert "".join(c.text for c in chunks) == texts["on"]
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be a number in"):
        client.completions.create(model=served.model, prompt=prompt, presence_penalty=3.0)


def test_several_completions_and_best_of(served: Served) -> None:
    """n = 3 (chat, seeded): three choices, choice i the tokens of a lone request seeded seed + i;
    the others' prompt blocks come from the prefix cache. best_of = 4, n = 2 (completions): the
    two of the four candidates with the highest cumulative log-probability, in that order."""
    client = served.openai()
    prompt = "abcabcabcabcabcabcabcabcabcabcabc"  # two full KV blocks and more
    off = {"speculation": "off", "ignore_eos": True, "return_token_ids": True}
    out = client.completions.create(model=served.model, prompt=prompt, n=3, max_tokens=12, temperature=1.0, seed=11,
                                    extra_body={"specdecode": off})
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 36
    for c in out.choices:
        alone = client.completions.create(model=served.model, prompt=prompt, max_tokens=12, temperature=1.0,
                                          seed=11 + c.index, extra_body={"specdecode": off})
        assert c.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    with served.grpc() as grpc_client:
        chunks = list(grpc_client.generate(prompt, max_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True))
    lasts = {c.index: c for c in chunks if c.HasField("usage")}
    assert sorted(lasts) == [0, 1, 2]
    assert all(lasts[i].usage.cached_prompt_tokens >= 16 for i in (1, 2))  # shared, not prefilled again
    chunks = list(client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "abc"}],
                                                 n=2, max_tokens=8, temperature=1.0, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}

    best = client.completions.create(model=served.model, prompt=prompt, n=2, best_of=4, max_tokens=10, temperature=1.0,
                                     seed=5, logprobs=0, extra_body={"specdecode": off})
    scores = []
    for i in range(4):
        alone = client.completions.create(model=served.model, prompt=prompt, max_tokens=10, temperature=1.0,
                                          seed=5 + i, logprobs=0, extra_body={"specdecode": off})
        scores.append((sum(alone.choices[0].logprobs.token_logprobs), alone.choices[0].text))
    expected = [text for _, text in sorted(scores, reverse=True)[:2]]
    assert [c.text for c in best.choices] == expected
    with pytest.raises(openai.BadRequestError, match="n: must be in"):
        client.completions.create(model=served.model, prompt=prompt, n=17)


def test_tool_choice_errors_with_the_openai_client(served: Served) -> None:
    """A bad tool_choice is a 400 naming it."""
    client = served.openai()
    tools = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "abc"}], tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice: needs tools"):
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "abc"}],
                                       tool_choice="required")


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                   "required": ["city"], "additionalProperties": False}}}


def streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str]:
    """(content, calls as (id, name, arguments), finish_reason) accumulated from chat chunks the
    way OpenAI's docs accumulate them: by each tool call delta's `index`."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                got = calls.setdefault(d.index, ["", "", ""])
                got[0] += d.id or ""
                got[1] += (d.function.name or "") if d.function else ""
                got[2] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_calls_end_to_end_with_the_openai_client(served: Served, serve_instance) -> None:
    """Through Ray Serve with the openai client, on an app whose prompts hold a tool listing: a
    named and a required call come back as `tool_calls` that validate against the tool's schema,
    whole and streamed alike, the same with speculation as without; the call and the tool's
    result go back in the next turn (rendered, answered); `auto` and `none` answer in text."""
    import jsonschema
    from ray import serve

    from deployments.app import build_app

    app = "specdecode-tools"
    args = {"model": served.model, "device": "cpu", "dtype": "float32", "num_cpus": 1, "max_num_seqs": 2,
            "max_prompt_tokens": 2048, "max_tokens": 96, "default_max_tokens": 16,
            "speculative": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}}
    tools = [TIME_TOOL, WEATHER_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "what time is it in zone 3?"}]
    with serve_instance.apps(app):
        serve.run(build_app(args), name=app, route_prefix=f"/{app}")
        client = openai.OpenAI(base_url=f"{served.http_base.rsplit('/', 1)[0]}/{app}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        for _ in range(600):  # the app answers once its replica is up
            try:
                client.models.list()
                break
            except openai.APIError:
                time.sleep(0.1)
        for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
            results = {}
            for speculation in ("on", "off"):
                extra = {"specdecode": {"speculation": speculation}}
                whole = client.chat.completions.create(model=served.model, messages=messages, tools=tools,
                                                       tool_choice=choice, max_tokens=96, temperature=0.0,
                                                       extra_body=extra)
                (c,) = whole.choices
                assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
                for call in c.message.tool_calls:
                    assert call.type == "function" and call.id.startswith("call_")
                    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                if choice != "required":
                    assert [call.function.name for call in c.message.tool_calls] == ["get_time"]
                stream = client.chat.completions.create(model=served.model, messages=messages, tools=tools,
                                                        tool_choice=choice, max_tokens=96, temperature=0.0,
                                                        extra_body=extra, stream=True)
                content, calls, finish = streamed_calls(stream)
                assert finish == "tool_calls" and (content or None) == c.message.content
                assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments)
                                                        for t in c.message.tool_calls]
                assert all(i.startswith("call_") for i, _, _ in calls)
                results[speculation] = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            assert results["on"] == results["off"]
        call = c.message.tool_calls[0]
        follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
        answer = client.chat.completions.create(model=served.model, messages=follow, tools=tools, max_tokens=8,
                                                temperature=0.0, tool_choice="none")
        assert answer.choices[0].message.tool_calls is None and answer.usage.prompt_tokens > 0
        for choice in ("auto", "none"):  # a random model writes no call block: text
            out = client.chat.completions.create(model=served.model, messages=messages, tools=tools,
                                                 tool_choice=choice, max_tokens=12, temperature=0.0)
            content, calls, finish = streamed_calls(client.chat.completions.create(
                model=served.model, messages=messages, tools=tools, tool_choice=choice, max_tokens=12,
                temperature=0.0, stream=True))
            assert out.choices[0].message.tool_calls is None and calls == []
            assert content == out.choices[0].message.content and finish == out.choices[0].finish_reason


def test_logprobs_are_the_same_with_and_without_speculation(served: Served) -> None:
    """completions' `logprobs` and chat's `logprobs`/`top_logprobs`, streamed and not, as the
    openai client parses them; greedy, so each token is its position's most likely one; the
    values equal with speculation and with it off (the verification's logits are the decode
    step's bits)."""
    client = served.openai()
    prompt = "abcabcabcabcabcabc"  # n-gram lookup drafts from the repetition
    runs = {}
    for mode in ("on", "off"):
        out = client.completions.create(model=served.model, prompt=prompt, logprobs=2, **GREEDY,
                                        extra_body={"specdecode": {"ignore_eos": True, "speculation": mode}})
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
        assert "".join(lp.tokens) == out.choices[0].text  # a character tokenizer: every token is whole
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
        for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            assert len(top) == 2 and value == max(top.values()) and value <= 0.0
        runs[mode] = (out.choices[0].text, lp.token_logprobs,
                      out.model_extra["specdecode"]["speculation"]["num_accepted_tokens"])
    assert runs["on"][2] > 0 and runs["off"][2] == 0
    assert runs["on"][:2] == runs["off"][:2]
    with served.grpc() as grpc_client:  # the gRPC API's field
        chunks = list(grpc_client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.logprob for lp in got] == runs["on"][1] and all(len(lp.top_logprobs) == 2 for lp in got)
    assert [lp.token_id for lp in got] == [t for c in chunks for t in c.token_ids]

    messages = [{"role": "user", "content": "abcabcabc"}]
    whole = client.chat.completions.create(model=served.model, messages=messages, logprobs=True, top_logprobs=3,
                                           extra_body=IGNORE_EOS, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == 24 and "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    chunks = list(client.chat.completions.create(model=served.model, messages=messages, logprobs=True,
                                                 top_logprobs=3, stream=True, extra_body=IGNORE_EOS, **GREEDY))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=served.model, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_stop_seed_and_speculation_cap_reach_the_engine(served: Served) -> None:
    client = served.openai()
    _, text, _ = grpc_greedy(served, "x = ", max_tokens=40)
    stop = text[5:7]
    out = client.completions.create(model=served.model, prompt="x = ", max_tokens=40, temperature=0.0, stop=stop,
                                    extra_body={"specdecode": {"ignore_eos": True}})
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=served.model, prompt="def g", max_tokens=16, temperature=1.0,
                                         top_p=0.9, seed=7, extra_body=IGNORE_EOS).choices[0].model_extra["token_ids"]
               for _ in range(2)]
    grpc_ids, _, _ = grpc_greedy(served, "def g", max_tokens=16)
    assert sampled[0] == sampled[1] != grpc_ids  # seeded: repeatable, and not the greedy answer
    capped = client.completions.create(model=served.model, prompt=[90, 3, 3, 3, 3, 3, 3, 77], **GREEDY,
                                       extra_body={"specdecode": {"ignore_eos": True, "max_speculative_tokens": 0}})
    assert capped.model_extra["specdecode"]["speculation"]["num_draft_tokens"] == 0


# --- errors ------------------------------------------------------------------------------------------
def test_errors_are_openai_errors(served: Served) -> None:
    client = served.openai()
    m = served.model
    cases = [
        (openai.BadRequestError, "n", dict(n=17)),
        (openai.BadRequestError, "max_tokens", dict(max_tokens=LONG + 1)),
        (openai.BadRequestError, "temperature", dict(temperature=-0.5)),
        (openai.BadRequestError, "logprobs", dict(logprobs=6)),
        (openai.BadRequestError, "specdecode.speculatoin", dict(extra_body={"specdecode": {"speculatoin": "on"}})),
        (openai.BadRequestError, "prompt", dict(prompt="a" * 65)),
        (openai.BadRequestError, "prompt", dict(prompt=[1, 97])),
        (openai.BadRequestError, "prompt", dict(prompt=["a", "b"])),
        (openai.NotFoundError, "model", dict(model="gpt-4o")),
        (openai.BadRequestError, "request_id", dict(extra_body={"specdecode": {"request_id": "x" * 300}})),
        (openai.BadRequestError, "request_id", dict(extra_headers={"X-Request-Id": "a\tb"})),
    ]
    for exc, param, kwargs in cases:
        kwargs = {"model": m, "prompt": "a", "max_tokens": 4, **kwargs}
        with pytest.raises(exc) as info:
            client.completions.create(**kwargs)
        error = info.value.body
        assert error["param"] == param or error["message"].startswith(param), (kwargs, error)
        assert error["message"] and "Traceback" not in error["message"] and error["type"], error
    with pytest.raises(openai.BadRequestError) as info:  # one message, not one per branch of the union
        client.completions.create(model=m, prompt=None, max_tokens=4)
    assert info.value.body["message"] == "prompt: must be a string or a list of token ids, got null"
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=m, messages=[])
    import urllib.error
    import urllib.request

    bad_json = urllib.request.Request(f"{served.http_base}/v1/completions", data=b'{"model": ', method="POST",
                                      headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(bad_json, timeout=30)
    assert raw.value.code == 400 and "not valid JSON" in json.loads(raw.value.read())["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):  # refused before the stream starts
        client.completions.create(model=m, prompt="a", max_tokens=4, stream=True, temperature=-1.0)


def test_disaggregated_mode_serves_http_the_same(served: Served) -> None:
    """A prefill/decode app (prompts of >= 16 tokens prefilled by the prefill pool and handed over
    through the object store) on the same Serve: HTTP completions and chat equal the co-located
    app's gRPC output, and the decode replica counts them as prefilled remotely."""
    from ray import serve

    from deployments.app import bind_app
    from deployments.config import AppConfig

    pd_app = f"{APP}-pd"
    args = {"model": served.model, "device": "cpu", "dtype": "float32", "max_num_seqs": 2, "max_prompt_tokens": 64,
            "max_tokens": 64, "default_max_tokens": 16, "mode": "disaggregated",
            "speculative": {"method": "ngram", "model": None, "num_speculative_tokens": 4, "adaptive": False},
            "disaggregation": {"min_prompt_tokens": 16, "transport": "object_store"}}
    no_cpus = {"ray_actor_options": {"num_cpus": 0}}  # the module's Ray has 2 CPUs; the main app holds 1
    serve.run(bind_app(AppConfig.from_dict(args), no_cpus, prefill_overrides=no_cpus), name=pd_app,
              route_prefix=f"/{pd_app}")
    try:
        client = openai.OpenAI(base_url=f"{served.http_base.removesuffix(APP)}{pd_app}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        prompt = "def fibonacci(n): return n if n < 2 else"
        ids, text, _ = grpc_greedy(served, prompt)
        chunks = list(client.completions.create(model=served.model, prompt=prompt, stream=True,
                                                extra_body=IGNORE_EOS, **GREEDY))
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
        assert "".join(c.choices[0].text for c in chunks) == text
        # log-probabilities: the prefill pool's first token's, then the decode replica's (a prompt
        # the decode replica has not cached, so the prefill pool prefills it)
        lp_prompt = "def lucas(k): return 2 - k if k < 2 else"
        pd_lp = client.completions.create(model=served.model, prompt=lp_prompt, logprobs=1, extra_body=IGNORE_EOS,
                                          **GREEDY).choices[0].logprobs
        local_lp = served.openai().completions.create(model=served.model, prompt=lp_prompt, logprobs=1,
                                                      extra_body=IGNORE_EOS, **GREEDY).choices[0].logprobs
        assert len(pd_lp.token_logprobs) == 24 and pd_lp.tokens == local_lp.tokens
        assert pd_lp.token_logprobs == pytest.approx(local_lp.token_logprobs, abs=1e-5)
        messages = [{"role": "user", "content": "write a function that adds two numbers"}]
        rendered = f"user: {messages[0]['content']}\nassistant: "
        _, chat_text, _ = grpc_greedy(served, rendered)
        out = client.chat.completions.create(model=served.model, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
        assert out.choices[0].message.content == chat_text
        counts = serve.get_deployment_handle("SpecDecode", app_name=pd_app).prefill_counts.remote().result(
            timeout_s=30)
        assert counts.get("remote", 0) == 3 and counts.get("fallback", 0) == 0, counts
    finally:
        serve.delete(pd_app)


# --- disconnects, models, health, tracing ---------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_the_kv_blocks(served: Served) -> None:
    client = served.openai()
    assert wait_idle(served, 30).num_used_blocks == 0
    for attempt in range(2):  # one retry: a disconnect racing the proxy's write is not the abort path
        stream = client.completions.create(model=served.model, prompt=[4, 5, 6, 7 + attempt], max_tokens=LONG,
                                           temperature=0.0, stream=True, extra_body=IGNORE_EOS)
        chunks = iter(stream)
        received = [next(chunks) for _ in range(3)]
        assert all(c.choices[0].text or c.choices[0].model_extra["token_ids"] for c in received)
        with served.grpc() as grpc_client:
            busy = grpc_client.model_info().usage
        assert busy.num_running == 1 and busy.num_used_blocks > 0
        stream.close()  # closes the HTTP connection
        usage = wait_idle(served, ABORT_WAIT_S)
        if usage.num_used_blocks == 0 and usage.num_running == 0:
            return
        assert wait_idle(served, 120).num_used_blocks == 0, "an orphaned request never finished"
    pytest.fail("the engine request outlived the HTTP client twice in a row")


def test_models_and_health(served: Served) -> None:
    import urllib.request

    models = served.openai().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert models.data[0].model_extra["specdecode"]["drafter_method"] == "ngram"
    assert models.data[0].model_extra["specdecode"]["has_chat_template"] is True
    # the official client's models.retrieve (GET /v1/models/{id}; the id may hold slashes)
    one = served.openai().models.retrieve(served.model)
    assert one.id == served.model and one.model_extra == models.data[0].model_extra
    with pytest.raises(openai.NotFoundError) as e:
        served.openai().models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and served.model in e.value.body["message"]
    with urllib.request.urlopen(f"{served.http_base}/health", timeout=30) as response:
        body = json.loads(response.read())
        assert response.status == 200 and body["status"] == "ok" and body["pools"] == {"decode": "ok"}


def test_traceparent_header_parents_the_replica_span(served: Served) -> None:
    import deployments.tracing as tr

    client = served.openai(default_headers={"traceparent": TRACEPARENT})
    client.completions.create(model=served.model, prompt="def h", max_tokens=8, temperature=0.0,
                              extra_body={"specdecode": {"request_id": "http-traced"}})
    deadline = time.monotonic() + 20
    spans: list[dict] = []
    while time.monotonic() < deadline:
        text = served.spans_file.read_text() if served.spans_file.exists() else ""
        spans = [json.loads(line) for line in text.splitlines()]
        if any(s["name"] == tr.REQUEST_SPAN and s["trace_id"] == TRACE_ID for s in spans):
            break
        time.sleep(0.2)
    (span,) = [s for s in spans if s["name"] == tr.REQUEST_SPAN and s["trace_id"] == TRACE_ID]
    assert span["parent_span_id"] == "b7ad6b7169203331"
    assert span["attributes"]["http.route"] == "/v1/completions"
    assert span["attributes"][tr.ATTR_CLIENT_REQUEST_ID] == "http-traced"
