"""The HTTP API's translation on its own (no Ray): OpenAI request -> GenerateRequest, refusals that
name their field, gRPC statuses -> HTTP statuses with no internal text, response objects from
GenerateResponse messages, and the replica's chat-template rendering. The whole path, with the
`openai` client against Ray Serve, is tests/test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments.config import AppConfig
from deployments.errors import ClientError
from deployments.openai_api import (
    INTERNAL_MESSAGE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    api_error,
    chat_messages,
    check_model,
    check_supported,
    completion_prompt,
    generate_request,
)
from deployments.replica import SpecDecodeServer
from protos.specdecode.v1 import specdecode_pb2 as pb


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "def f", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_fields_map_onto_the_grpc_request() -> None:
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n", unknown_new_field=1,
                     specdecode={"speculation": "off", "max_speculative_tokens": 2, "top_k": 5, "ignore_eos": True,
                                 "stop_token_ids": [2], "request_id": "r1"})
    out = generate_request(req, completion_prompt(req))
    assert out.prompt == "def f" and out.max_tokens == 7 and out.temperature == 0.5 and out.top_p == 0.9
    assert (out.seed, list(out.stop), list(out.stop_token_ids), out.top_k) == (3, ["\n"], [2], 5)
    assert out.speculation == pb.SPECULATION_MODE_OFF and out.max_speculative_tokens == 2
    assert out.ignore_eos and out.request_id == "r1"
    unset = generate_request(completion(), "x")
    assert not any(unset.HasField(f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed"))
    ids = generate_request(completion(prompt=[[4, 5, 6]]), completion_prompt(completion(prompt=[[4, 5, 6]])))
    assert list(ids.prompt_token_ids.ids) == [4, 5, 6] and ids.WhichOneof("input") == "prompt_token_ids"
    assert generate_request(chat(max_completion_tokens=9), None).max_tokens == 9
    assert generate_request(chat(max_tokens=8), None).WhichOneof("input") is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"best_of": 3, "stream": True}, "best_of"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_completion_fields_are_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        check_supported(completion(**fields))
    assert (info.value.status, info.value.param) == (400, param) and info.value.message.startswith(param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"), ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
])
def test_unsupported_chat_fields_are_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        check_supported(chat(**fields))
    assert info.value.param == param
    check_supported(chat(n=1, presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"},
                         max_tokens=4, max_completion_tokens=4, tool_choice="none"))


def test_response_formats_and_grammars_become_the_structured_output_field() -> None:
    from deployments.openai_api import generate_request as gr

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    made = gr(chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                           "strict": True}}), None)
    assert json.loads(made.structured_output.json_schema) == schema
    assert gr(chat(response_format={"type": "json_object"}), None).structured_output.json_object
    assert not gr(chat(response_format={"type": "text"}), None).HasField("structured_output")
    assert gr(completion(specdecode={"regex": "a+"}), "x").structured_output.regex == "a+"
    assert gr(completion(specdecode={"grammar": 'start: "x"'}), "x").structured_output.grammar == 'start: "x"'
    for fields, match in [({"response_format": {"type": "xml"}}, "type must be text, json_object or json_schema"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "needs"),
                          ({"response_format": {"type": "json_object"}, "specdecode": {"regex": "a"}}, "one of")]:
        with pytest.raises(ApiError, match=match) as info:
            gr(chat(**fields), None)
        assert info.value.param == "response_format"


def test_penalties_and_biases_reach_the_request() -> None:
    from deployments.openai_api import generate_request as gr

    made = gr(chat(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"5": 3.0, "17": -100},
                   specdecode={"repetition_penalty": 1.2, "min_tokens": 4}), None)
    assert (made.presence_penalty, made.frequency_penalty, made.repetition_penalty, made.min_tokens) == (0.5, -0.25, 1.2, 4)
    assert dict(made.logit_bias) == {5: 3.0, 17: -100.0}
    assert not gr(chat(), None).HasField("presence_penalty")
    with pytest.raises(ApiError, match="logit_bias: keys are token ids"):
        gr(chat(logit_bias={"the": 1.0}), None)
    with pytest.raises(ApiError, match="logit_bias: must be in"):
        gr(chat(logit_bias={"-3": 1.0}), None)


def test_ranges_of_the_proto_types_and_batches_and_models() -> None:
    for fields, param in [({"max_tokens": 2**31}, "max_tokens"), ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"),
                          ({"specdecode": {"max_speculative_tokens": -1}}, "specdecode.max_speculative_tokens"),
                          ({"specdecode": {"stop_token_ids": [2**40]}}, "specdecode.stop_token_ids")]:
        with pytest.raises(ApiError) as info:
            generate_request(completion(**fields), "x")
        assert info.value.param == param, fields
    with pytest.raises(ApiError, match="prompt: must be in"):
        generate_request(completion(), [1, -3])
    with pytest.raises(ApiError, match="batch of 2"):
        completion_prompt(completion(prompt=["a", "b"]))
    assert completion_prompt(completion(prompt=["only"])) == "only"
    with pytest.raises(ApiError) as info:
        check_model("gpt-4o", "models/target")
    assert info.value.status == 404 and "models/target" in info.value.message
    check_model("models/target", "models/target")


def test_chat_messages_take_text_parts_only() -> None:
    req = chat(messages=[{"role": "system", "content": None},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat_messages(req) == [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    with pytest.raises(ApiError, match=r"messages\[0\]\.content: only text parts"):
        chat_messages(image)


def test_statuses_map_to_http_without_internal_text() -> None:
    cases = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
             "DEADLINE_EXCEEDED": 504}
    for code, status in cases.items():
        err = api_error(ClientError(code, "max_tokens: 5 exceeds this deployment's cap of 4"), "label")
        assert err.status == status and err.message.startswith("max_tokens")
        assert err.param == ("max_tokens" if status == 400 else None)
    internal = api_error(ClientError("INTERNAL", "engine error: CUDA out of memory at llama.py:88"), "label")
    assert internal.status == 500 and internal.message == INTERNAL_MESSAGE and "llama" not in internal.message


def _message(text: str, ids: list[int], last: bool = False, index: int = 0) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id="r", token_ids=ids, text=text, index=index)
    if last:
        msg.finish_reason = pb.FINISH_REASON_LENGTH
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=1))
        msg.speculation.CopyFrom(pb.SpeculationStats(enabled=True, num_draft_tokens=4, num_accepted_tokens=2))
    return msg


def test_responses_and_chunks_from_messages() -> None:
    messages = [_message("ab", [5, 6]), _message("c", [7], last=True)]
    whole = ResponseBuilder(chat=False, model="m", label="x", return_token_ids=True).whole(messages)
    (choice,) = whole["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("abc", [5, 6, 7], "length")
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert whole["specdecode"]["speculation"]["num_accepted_tokens"] == 2 and whole["id"] == "cmpl-x"
    builder = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False)
    first, last = builder.chunk(messages[0]), builder.chunk(messages[1])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                            "content": "ab"}
    assert first["choices"][0]["finish_reason"] is None and "specdecode" not in first
    assert last["choices"][0]["delta"] == {"content": "c"} and last["choices"][0]["finish_reason"] == "length"
    assert last["specdecode"]["speculation"]["enabled"] is True
    usage = builder.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6


def test_several_completions_make_one_choice_each() -> None:
    """n = 2: messages of both completions interleaved; each choice its own text and finish, the
    prompt counted once in the usage and the completions' tokens summed."""
    messages = [_message("ab", [5, 6], index=1), _message("x", [9]), _message("c", [7], last=True, index=1),
                _message("yz", [10, 11], last=True)]
    whole = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=True, n=2).whole(messages)
    assert [(c["index"], c["message"]["content"], c["token_ids"]) for c in whole["choices"]] == [
        (0, "xyz", [9, 10, 11]), (1, "abc", [5, 6, 7])]
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 6
    assert whole["specdecode"]["speculation"]["num_draft_tokens"] == 8
    builder = ResponseBuilder(chat=True, model="m", label="x", return_token_ids=False, n=2)
    chunks = [builder.chunk(m) for m in messages[:3]]
    assert [c["choices"][0]["index"] for c in chunks] == [1, 0, 1]
    assert "role" in chunks[0]["choices"][0]["delta"] and "role" in chunks[1]["choices"][0]["delta"]
    assert "role" not in chunks[2]["choices"][0]["delta"] and not builder.finished
    builder.chunk(messages[3])
    assert builder.finished and builder.usage_chunk()["usage"]["completion_tokens"] == 6


def _fake_replica(tokenizer) -> SimpleNamespace:
    llm = SimpleNamespace(tokenizer=tokenizer, max_prompt_chars=lambda n: n * 4)
    return SimpleNamespace(llm=llm, config=AppConfig(model="models/x"), max_prompt_tokens=64)


def test_replica_renders_chat_or_refuses_clearly(tmp_path) -> None:
    from test_serve_grpc import save_char_tokenizer
    from transformers import AutoTokenizer

    save_char_tokenizer(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ClientError) as info:
        asyncio.run(SpecDecodeServer.encode_chat(_fake_replica(tokenizer), messages))
    assert info.value.code_name == "INVALID_ARGUMENT" and "has no chat template" in info.value.details
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    ids = asyncio.run(SpecDecodeServer.encode_chat(_fake_replica(tokenizer), messages))
    assert tokenizer.decode(ids) == "user:hi;"
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ClientError, match="roles must alternate"):
        asyncio.run(SpecDecodeServer.encode_chat(_fake_replica(tokenizer), messages))
    with pytest.raises(ClientError, match="characters"):
        asyncio.run(SpecDecodeServer.encode_chat(_fake_replica(tokenizer), [{"role": "user", "content": "a" * 300}]))


def test_logprobs_map_onto_the_request() -> None:
    assert generate_request(completion(logprobs=3), "x").logprobs == 3
    assert not generate_request(completion(), "x").HasField("logprobs")
    assert generate_request(chat(logprobs=True, top_logprobs=5), None).logprobs == 5
    assert generate_request(chat(logprobs=True), None).logprobs == 0
    assert not generate_request(chat(logprobs=False), None).HasField("logprobs")
    for request, param in [(completion(logprobs=6), "logprobs"), (chat(logprobs=True, top_logprobs=21), "top_logprobs")]:
        with pytest.raises(ApiError) as info:
            generate_request(request, "x" if param == "logprobs" else None)
        assert (info.value.status, info.value.param) == (400, param)
