"""The OpenAI-compatible HTTP API, served by the ingress through Serve's HTTP proxy (port 8000):
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/models/{model}`, `GET /health`.

This module only translates. A request becomes a `specdecode.v1.GenerateRequest` (a chat request:
plus its messages, which the engine replica renders with the tokenizer's chat template) and goes
through `SpecDecodeIngress.generate`, the path every gRPC request takes: the replica's validation
and limits, the ingress's retries and bounded wait, cancellation, tracing and metrics are the
same. Out come JSON or server-sent events (`data: {...}` chunks, then `data: [DONE]`), and
`ClientError` statuses as OpenAI-style error bodies (`{"error": {"message", "type", "param",
"code"}}`; 400, 404, 429, 503, 504; internal details never reach the client).

What we accept beyond the OpenAI fields sits under one field, `specdecode` (`SpecDecodeOptions`:
speculation on/off/default, a k cap, top_k, ignore_eos, stop_token_ids, request_id,
return_token_ids, token_healing); what we return beyond them sits under `specdecode` in the
response or in the stream's finishing chunk (speculation stats and server-side timing). Structured output comes from `response_format` (`json_object`, `json_schema`) or our
`specdecode.regex` / `specdecode.grammar` (Lark or GBNF); tool calls from `tools` and
`tool_choice` (deployments/tools.py). Fields that change what is generated and that we do not
implement (echo, suffix) are refused with a 400 naming them;
unknown fields are ignored, as OpenAI's newer fields are by other servers.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.common import MAX_REQUEST_ID_CHARS
from deployments.errors import ClientError
from deployments.health import DECODE
from deployments.tools import CallStream, openai_message_calls
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"
TRACE_HEADERS = ("traceparent", "tracestate")
INT32_MAX = 2**31 - 1
# gRPC status of a ClientError -> HTTP status and OpenAI error type.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499,
}
ERROR_TYPES = {
    400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 499: "cancelled",
    500: "internal_error", 503: "service_unavailable", 504: "timeout",
}
INTERNAL_MESSAGE = "the server failed this request; retry it"  # the details stay in the ingress's log
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
SPECULATION = {"default": pb.SPECULATION_MODE_DEFAULT, "on": pb.SPECULATION_MODE_ON, "off": pb.SPECULATION_MODE_OFF}


# --- requests -----------------------------------------------------------------------------------
class SpecDecodeOptions(BaseModel):
    """Our extensions, in the request's `specdecode` field (the openai client: `extra_body=
    {"specdecode": {...}}`). Unknown keys here are refused: a typo must not pass silently."""

    model_config = ConfigDict(extra="forbid")
    speculation: Literal["default", "on", "off"] = "default"  # on: 400 if the deployment has no drafter
    max_speculative_tokens: int | None = None  # cap on k for this request, in [0, 64]; 0 = no speculation
    top_k: int | None = None  # 0 = off
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    request_id: str = ""  # a label for logs and traces (default: the X-Request-Id header, else random)
    return_token_ids: bool = False  # each choice (and chunk) also carries its token ids
    token_healing: bool = False  # heal a text prompt's last token (GenerateRequest.token_healing)
    repetition_penalty: float | None = None  # > 0, 1 = off (vLLM's)
    min_tokens: int | None = None  # no end of sequence or stop token before this many tokens
    regex: str | None = None  # structured output: the whole output matches this regular expression
    grammar: str | None = None  # structured output: ... this Lark grammar (or GBNF)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    specdecode: SpecDecodeOptions = Field(default_factory=SpecDecodeOptions)


def _prompt_shape(value: Any) -> Any:
    """One plain message for a prompt of the wrong type, instead of one per branch of the union."""
    if isinstance(value, str | list):
        return value
    raise ValueError(f"must be a string or a list of token ids, got {type(value).__name__ if value is not None else 'null'}")


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_prompt_shape)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool turn's answer to this call


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


class ApiError(Exception):
    """A request refused before it reaches an engine replica, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, "INVALID_ARGUMENT")


def check_model(model: str, served: str) -> None:
    if model != served:
        raise ApiError(404, f"model: {model!r} is not served here; this deployment serves {served!r} "
                            "(GET /v1/models)", "model", "model_not_found")


def check_supported(req: _GenerationRequest) -> None:
    """Refuse, naming the field, what would change the output and that we do not implement."""
    if req.stream_options is not None and not req.stream:
        raise _invalid("stream_options", "only with stream: true")
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of > (req.n or 1) and req.stream:
            raise _invalid("best_of", "cannot be used with stream: the best completions are known once all have finished")
        if req.echo:
            raise _invalid("echo", "is not supported; the prompt is not repeated in the output")
        if req.suffix:
            raise _invalid("suffix", "is not supported (no fill-in-the-middle)")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise _invalid("top_logprobs", "needs logprobs: true")
        if req.tool_choice not in (None, "none") and not req.tools:
            raise _invalid("tool_choice", "needs tools")
        if (req.max_tokens is not None and req.max_completion_tokens is not None
                and req.max_tokens != req.max_completion_tokens):
            raise _invalid("max_completion_tokens", f"{req.max_completion_tokens} differs from max_tokens "
                                                    f"{req.max_tokens}; set one of them")


def _in_range(param: str, value: int | None, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        raise _invalid(param, f"must be in [{lo}, {hi}], got {value}")


def generate_request(req: _GenerationRequest, prompt: str | list[int] | None) -> pb.GenerateRequest:
    """The GenerateRequest a gRPC client would send for `req` (prompt None: a chat request). Only
    the ranges of the proto's integer types are checked here; every other check is the replica's."""
    ext = req.specdecode
    max_tokens = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    _in_range("max_tokens", max_tokens, 1, INT32_MAX)
    _in_range("seed", req.seed, 0, 2**63 - 1)
    _in_range("n", req.n, 1, 2**32 - 1)
    if isinstance(req, CompletionRequest):
        _in_range("best_of", req.best_of, 1, 2**32 - 1)
    _in_range("specdecode.top_k", ext.top_k, 0, INT32_MAX)
    _in_range("specdecode.max_speculative_tokens", ext.max_speculative_tokens, 0, 2**32 - 1)
    for t in ext.stop_token_ids:
        _in_range("specdecode.stop_token_ids", t, 0, INT32_MAX)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    out = pb.GenerateRequest(stop=stop, stop_token_ids=ext.stop_token_ids, ignore_eos=ext.ignore_eos,
                             speculation=SPECULATION[ext.speculation], request_id=ext.request_id,
                             token_healing=ext.token_healing)
    if isinstance(prompt, str):
        out.prompt = prompt
    elif prompt is not None:
        for t in prompt:
            _in_range("prompt", t, 0, INT32_MAX)
        out.prompt_token_ids.CopyFrom(pb.TokenIds(ids=prompt))
    optional = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "top_k": ext.top_k, "seed": req.seed, "max_speculative_tokens": ext.max_speculative_tokens,
                "logprobs": requested_logprobs(req), "n": req.n if req.n != 1 else None,
                "best_of": req.best_of if isinstance(req, CompletionRequest) else None}
    for name, value in optional.items():
        if value is not None:
            setattr(out, name, value)
    for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty),
                        ("repetition_penalty", ext.repetition_penalty), ("min_tokens", ext.min_tokens)):
        if value is not None:
            if name == "min_tokens":
                _in_range("specdecode.min_tokens", value, 0, 2**32 - 1)
            setattr(out, name, value)
    for token, bias in (req.logit_bias or {}).items():
        try:
            token_id = int(token)
        except ValueError:
            raise _invalid("logit_bias", f"keys are token ids, got {token!r}") from None
        _in_range("logit_bias", token_id, 0, INT32_MAX)
        out.logit_bias[token_id] = float(bias)
    structured = requested_structure(req)
    if structured is not None:
        out.structured_output.CopyFrom(structured)
    if isinstance(req, ChatCompletionRequest):
        request_tools(req, out)
    return out


def requested_structure(req: _GenerationRequest) -> pb.StructuredOutput | None:
    """What the output must match: `response_format` (json_object; json_schema with its
    `json_schema.schema`; text: nothing) or our `specdecode.regex` / `specdecode.grammar`; at most one."""
    asked = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(pb.StructuredOutput(json_object=True))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                raise _invalid("response_format", "json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                                  "{...}}}")
            asked.append(pb.StructuredOutput(json_schema=json.dumps(spec["schema"])))
        elif kind != "text":
            raise _invalid("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    if req.specdecode.regex is not None:
        asked.append(pb.StructuredOutput(regex=req.specdecode.regex))
    if req.specdecode.grammar is not None:
        asked.append(pb.StructuredOutput(grammar=req.specdecode.grammar))
    if len(asked) > 1:
        raise _invalid("response_format", "give one of response_format, specdecode.regex and specdecode.grammar")
    return asked[0] if asked else None


def requested_logprobs(req: _GenerationRequest) -> int | None:
    """The alternatives per token a request asks for (GenerateRequest.logprobs), None for none:
    completions' `logprobs` (0-5, the legacy API's limit), chat's `top_logprobs` (0-20) with
    `logprobs: true`."""
    if isinstance(req, CompletionRequest):
        _in_range("logprobs", req.logprobs, 0, 5)
        return req.logprobs
    if not req.logprobs:
        return None
    _in_range("top_logprobs", req.top_logprobs, 0, 20)
    return req.top_logprobs or 0


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (a batch of one is unwrapped)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise _invalid("prompt", f"one prompt per request, got a batch of {len(prompt)}; send them "
                                     "as separate requests")
        prompt = prompt[0]
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: {"role", "content"} with text content."""
    out = []
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content if part.type != "text"})
            if kinds:
                raise _invalid(f"messages[{i}].content", f"only text parts are supported, got {', '.join(kinds)}")
            content = "".join(part.text or "" for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = openai_message_calls(message.tool_calls)
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def request_tools(req: ChatCompletionRequest, out: pb.GenerateRequest) -> None:
    """`tools` and `tool_choice` (OpenAI's shapes) into the GenerateRequest."""
    for i, tool in enumerate(req.tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise _invalid(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\", ...}}")
        out.tools.add(name=str(function.get("name", "")), description=str(function.get("description") or ""),
                      parameters=json.dumps(function.get("parameters") or {"type": "object", "properties": {}}))
    choice = req.tool_choice
    if choice is None:
        return
    if choice in ("none", "auto", "required"):
        setattr(out.tool_choice, choice, True)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and choice["function"].get("name"):
        out.tool_choice.function = str(choice["function"]["name"])
    else:
        raise _invalid("tool_choice", f"none, auto, required or {{\"type\": \"function\", \"function\": "
                                      f"{{\"name\": ...}}}}, got {choice!r}")


# --- responses ------------------------------------------------------------------------------------
def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   extra: dict | None = None) -> JSONResponse:
    """An OpenAI-style error body (after the fields of `extra`)."""
    body = {**(extra or {}),
            "error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def api_error(e: ClientError, label: str) -> ApiError:
    """The HTTP form of a ClientError, logged once (one line, as the gRPC path's). Statuses that
    are our faults (INTERNAL, ...) get a plain message; their details stay in this log."""
    status = HTTP_STATUS.get(e.code_name)
    if len(label) > MAX_REQUEST_ID_CHARS:  # refused for it (the ingress checks it first): not whole into the log
        label = f"{label[:64]}...({len(label)} characters)"
    if status is None:
        logger.error("request %r failed: %s", label, e)
        return ApiError(500, INTERNAL_MESSAGE, None, e.code_name)
    if status == 499:
        logger.info("request %r cancelled by the client", label)
    else:
        logger.warning("request %r refused: %s", label, e)
    head = e.details.split(":", 1)[0]
    param = head if status == 400 and head.replace("_", "").replace(".", "").isalnum() else None
    return ApiError(status, e.details, param, e.code_name)


def _usage(lasts: list[pb.GenerateResponse]) -> dict:
    """Usage of a request from its completions' last messages: the prompt once, every
    completion's tokens."""
    u = lasts[0].usage
    completion = sum(m.usage.completion_tokens for m in lasts)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def _stats(lasts: list[pb.GenerateResponse]) -> dict:
    """Speculation stats and server-side timing over a request's completions (their last messages)."""
    drafted = sum(m.speculation.num_draft_tokens for m in lasts)
    accepted = sum(m.speculation.num_accepted_tokens for m in lasts)
    steps = sum(m.speculation.num_verify_steps for m in lasts)
    return {
        "speculation": {
            "enabled": lasts[0].speculation.enabled, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "num_verify_steps": steps, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
            "draft_time_s": sum(m.speculation.draft_time_s for m in lasts),
            "verify_time_s": sum(m.speculation.verify_time_s for m in lasts),
        },
        "timing": {"ttft_s": min(m.timing.ttft_s for m in lasts), "e2e_s": max(m.timing.e2e_s for m in lasts)},
    }


class ResponseBuilder:
    """OpenAI objects from a stream of GenerateResponse messages of `n` completions (each message
    names its completion: `index`): chunks one message at a time, or one whole response. A
    completion's last message carries its usage and finishes its choice."""

    def __init__(self, chat: bool, model: str, label: str, return_token_ids: bool, logprobs: bool = False,
                 n: int = 1, tool_names: Collection[str] = ()) -> None:
        self.chat, self.model, self.return_token_ids, self.logprobs = chat, model, return_token_ids, logprobs
        self.n = n
        # tools that may be called: each choice's text goes through a CallStream, which holds call
        # blocks until they close and sends them as tool_calls
        self.tool_names = frozenset(tool_names) if chat else frozenset()
        self.calls: dict[int, CallStream] = {}
        self.num_calls: dict[int, int] = {}  # tool_calls streamed per choice (their `index`)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{label}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.sent_role: set[int] = set()  # choices whose first chunk went out
        self.text_offset: dict[int, int] = {}  # completions' logprobs: where each choice's next token's text starts
        self.lasts: dict[int, pb.GenerateResponse] = {}  # each finished choice's last message

    def _logprobs(self, index: int, logprobs: list[pb.TokenLogprob]) -> dict | None:
        """A choice's `logprobs` for these tokens: chat's `content` list, or the completions API's
        parallel lists (`text_offset`: each token's start in the choice's text so far)."""
        if not self.logprobs:
            return None
        if self.chat:
            def entry(lp: pb.TokenLogprob) -> dict:
                return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes)}

            return {"content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top_logprobs]} for lp in logprobs],
                    "refusal": None}
        offsets = []
        for lp in logprobs:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(lp.token)
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
                "text_offset": offsets}

    @staticmethod
    def is_last(message: pb.GenerateResponse) -> bool:
        return message.HasField("usage")

    @property
    def finished(self) -> bool:
        """Every choice has had its last message."""
        return len(self.lasts) == self.n

    def _head(self, chunk: bool) -> dict:
        kind = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, message: pb.GenerateResponse) -> dict | None:
        """The chunk of one message (None: nothing to send yet, its text held as a possible call)."""
        last = self.is_last(message)
        index = message.index
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"content": message.text}
            if self.tool_names:
                delta = self._call_delta(index, message.text, last)
                if not delta and not last and not (self.logprobs or self.return_token_ids):
                    return None
            if index not in self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role.add(index)
            choice["delta"] = delta
        else:
            choice["text"] = message.text
        if self.return_token_ids:
            choice["token_ids"] = list(message.token_ids)
        choice["logprobs"] = self._logprobs(index, list(message.logprobs))
        choice["finish_reason"] = FINISH_REASONS.get(message.finish_reason, "stop") if last else None
        out = {**self._head(True), "choices": [choice]}
        if last:
            self.lasts[index] = message
            out["specdecode"] = _stats([message])
        return out

    def _call_delta(self, index: int, text: str, last: bool) -> dict:
        """A delta of what `text` lets a choice send: content outside call blocks, and the calls
        whose blocks closed (numbered across the choice's stream)."""
        stream = self.calls.setdefault(index, CallStream(self.tool_names))
        content, calls = stream.feed(text)
        if last:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first = self.num_calls.get(index, 0)
            self.num_calls[index] = first + len(calls)
            delta["tool_calls"] = [{"index": first + i, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for i, c in enumerate(calls)]
        return delta

    def _call_fields(self, text: str, calls: Any) -> dict:
        """A whole choice's content and tool_calls (the replica's, in OpenAI's shape): the text
        outside the call blocks as `CallStream` splits it, or None when there is none."""
        if not calls:
            return {"content": text}
        stream = CallStream(self.tool_names)
        content = stream.feed(text)[0] + stream.finish()[0]
        entries = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for c in calls]
        return {"content": content or None, "tool_calls": entries}

    def usage_chunk(self) -> dict:
        lasts = [self.lasts[i] for i in sorted(self.lasts)]
        return {**self._head(True), "choices": [], "usage": _usage(lasts), "specdecode": _stats(lasts)}

    def whole(self, messages: list[pb.GenerateResponse]) -> dict:
        by_index: dict[int, list[pb.GenerateResponse]] = {}
        for m in messages:
            by_index.setdefault(m.index, []).append(m)
        choices, lasts = [], []
        for index in sorted(by_index):
            mine = by_index[index]
            last = mine[-1]
            lasts.append(last)
            text = "".join(m.text for m in mine)
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if self.tool_names:
                    choice["message"] = {"role": "assistant", **self._call_fields(text, last.tool_calls)}
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = [t for m in mine for t in m.token_ids]
            choice["logprobs"] = self._logprobs(index, [lp for m in mine for lp in m.logprobs])
            choice["finish_reason"] = FINISH_REASONS.get(last.finish_reason, "stop")
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": _usage(lasts), "specdecode": _stats(lasts)}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


# --- the app --------------------------------------------------------------------------------------
def build_http_app(ingress: Any) -> FastAPI:
    """The FastAPI app of `ingress` (a SpecDecodeIngress: `generate`, `model_info`, `config`, `health`)."""
    served_model = ingress.config.model_id
    created = int(time.time())
    app = FastAPI(title="specdecode: OpenAI-compatible API", docs_url="/docs", redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        problems, params = [], []
        for err in e.errors()[:3]:
            if err.get("type") == "json_invalid":
                detail = (err.get("ctx") or {}).get("error", "")
                return error_response(400, f"body: not valid JSON ({detail})", "body", "INVALID_ARGUMENT")
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".") or "body"
            problems.append(f"{param}: {err.get('msg', 'invalid').removeprefix('Value error, ')}")
            params.append(param)
        return error_response(400, "; ".join(problems), params[0] if params else None, "INVALID_ARGUMENT")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    @app.post(COMPLETIONS_ROUTE)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, served_model)
        check_supported(body)
        return await _respond(ingress, request, body, generate_request(body, completion_prompt(body)), None,
                              COMPLETIONS_ROUTE)

    @app.post(CHAT_ROUTE)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model, served_model)
        check_supported(body)
        messages = chat_messages(body)
        return await _respond(ingress, request, body, generate_request(body, None), messages, CHAT_ROUTE)

    async def model_card() -> dict:
        """The served model, with an engine replica's limits (503 when none answers)."""
        try:
            info = await ingress.model_info()
        except ClientError as e:
            raise api_error(e, "models") from None
        limits = info.limits
        return {
            "id": served_model, "object": "model", "created": created, "owned_by": "specdecode",
            "max_model_len": limits.max_model_len,
            "specdecode": {
                "drafter_method": info.drafter_method or None, "num_speculative_tokens": info.num_speculative_tokens,
                "has_tokenizer": info.has_tokenizer, "has_chat_template": info.has_chat_template,
                "vocab_size": limits.vocab_size,
                "max_prompt_tokens": limits.max_prompt_tokens, "max_tokens": limits.max_tokens,
                "default_max_tokens": limits.default_max_tokens,
            },
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model:path}")  # a path: model ids are often folders ("models/target")
    async def retrieve_model(model: str) -> dict:
        check_model(model, served_model)
        return await model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the decode pool answers within HEALTH_TIMEOUT_S, else 503 (with the error body
        of an UNAVAILABLE request); the body says each pool's state (`HealthReport.body`)."""
        report = await ingress.health.report()
        if report.status != "unavailable":
            return JSONResponse(report.body())
        return error_response(503, report.pools[DECODE].reason, code="UNAVAILABLE", extra=report.body())

    return app


async def _respond(ingress: Any, request: Request, body: _GenerationRequest, generate: pb.GenerateRequest,
                   messages: list[dict[str, str]] | None, route: str):
    """Run the request through the ingress: one JSON response, or a stream of SSE chunks that
    starts once the first message arrived (so a refusal is still an HTTP status)."""
    label = body.specdecode.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
    trace = [(k, request.headers[k]) for k in TRACE_HEADERS if k in request.headers]
    builder = ResponseBuilder(messages is not None, body.model, label, body.specdecode.return_token_ids,
                              generate.HasField("logprobs"), generate.n if generate.HasField("n") else 1,
                              [] if generate.tool_choice.WhichOneof("choice") == "none" else
                              [t.name for t in generate.tools])
    stream = ingress.generate(generate, label, trace, messages, route)
    if not body.stream:
        async with aclosing(stream):
            try:
                collected = [m async for m in stream]
            except ClientError as e:
                raise api_error(e, label) from None
        if len({m.index for m in collected if builder.is_last(m)}) != builder.n:
            logger.error("request %r: the stream ended without its last message", label)
            raise ApiError(500, INTERNAL_MESSAGE)
        return builder.whole(collected)
    try:
        first = await anext(stream)
    except ClientError as e:
        await stream.aclose()
        raise api_error(e, label) from None
    except StopAsyncIteration:
        logger.error("request %r: the stream ended without a message", label)
        raise ApiError(500, INTERNAL_MESSAGE) from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_events(stream, first, builder, include_usage, label), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(stream: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse, builder: ResponseBuilder,
                  include_usage: bool, label: str) -> AsyncIterator[str]:
    """SSE chunks; a failure after the first chunk is an `error` event (the output is incomplete)
    and no [DONE]. Leaving early (client disconnect) closes `stream`, which cancels the request."""
    async with aclosing(stream):
        message = first
        try:
            while True:
                chunk = builder.chunk(message)
                if chunk is not None:
                    yield _sse(chunk)
                if builder.finished:
                    break
                message = await anext(stream)
        except ClientError as e:
            err = api_error(e, label)
            yield _sse({"error": {"message": err.message, "type": ERROR_TYPES.get(err.status, "error"),
                                  "param": err.param, "code": err.code}})
            return
        except StopAsyncIteration:
            logger.error("request %r: the stream ended without its last message", label)
            yield _sse({"error": {"message": INTERNAL_MESSAGE, "type": "internal_error", "param": None,
                                  "code": None}})
            return
        if include_usage:
            yield _sse(builder.usage_chunk())
        yield _sse("[DONE]")
