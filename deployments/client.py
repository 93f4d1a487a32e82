"""A gRPC client for the SpecDecode service: a small library and a command line.

    python -m deployments.client "def fib(n):" --max-tokens 64 --temperature 0

streams the completion to stdout as it arrives, then prints usage and speculation stats.
As a library: `SpecDecodeClient("localhost:9000").generate("def fib(n):", max_tokens=64)` yields
`GenerateResponse` chunks (closing the generator cancels the call); `.model_info()` returns
`ModelInfo`. Failures raise `grpc.RpcError` with the server's status code and details.
A call made while an OpenTelemetry span is active (or with `traceparent=`/`--traceparent`) sends
W3C `traceparent` metadata, so the replica's spans join the caller's trace.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

from protos.specdecode.v1 import specdecode_pb2 as pb
from protos.specdecode.v1 import specdecode_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:9000"
TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
SPECULATION_MODES = {"default": pb.SPECULATION_MODE_DEFAULT, "off": pb.SPECULATION_MODE_OFF, "on": pb.SPECULATION_MODE_ON}


def make_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    speculation: str | int = "default",
    max_speculative_tokens: int | None = None,
    request_id: str = "",
    logprobs: int | None = None,
    structured_output: Mapping[str, Any] | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; a str prompt is text, a sequence of ints is token ids, a sequence of
    {"role", "content"} mappings is a chat. None = server default. `logprobs`: each token's
    log-probability and that many alternatives in the responses (None: none).
    `structured_output`: one of {"json_schema": schema (a dict, or its JSON text)},
    {"json_object": True}, {"regex": "..."}, {"grammar": "..."} (None: free text). Penalties,
    `logit_bias` ({token id: bias}) and `min_tokens` as GenerateRequest documents them. `n`
    completions (each message's `index` says whose), the best `n` of `best_of`."""
    req = pb.GenerateRequest(
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, request_id=request_id,
        speculation=SPECULATION_MODES[speculation] if isinstance(speculation, str) else speculation,
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        req.chat.CopyFrom(pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]))
    else:
        req.prompt_token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    optional = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "seed": seed, "max_speculative_tokens": max_speculative_tokens, "logprobs": logprobs,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "repetition_penalty": repetition_penalty, "min_tokens": min_tokens, "n": n, "best_of": best_of}
    for name, value in optional.items():
        if value is not None:
            setattr(req, name, value)
    for token, bias in (logit_bias or {}).items():
        req.logit_bias[int(token)] = float(bias)
    if structured_output is not None:
        ((kind, value),) = structured_output.items()
        if kind == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        req.structured_output.CopyFrom(pb.StructuredOutput(**{kind: value}))
    return req


def trace_metadata(traceparent: str | None = None) -> tuple[tuple[str, str], ...]:
    """W3C trace context metadata: `traceparent` if given (validated), else the current
    OpenTelemetry span's context (nothing when no span is active)."""
    if traceparent is not None:
        if not TRACEPARENT_RE.match(traceparent):
            raise ValueError(f"traceparent must look like 00-<32 hex>-<16 hex>-<2 hex>, got {traceparent!r}")
        return (("traceparent", traceparent),)
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple((key, carrier[key]) for key in ("traceparent", "tracestate") if key in carrier)


class SpecDecodeClient:
    """Blocking client over one channel. `application` is the Serve app name (needed only when
    several apps share the proxy); `timeout` is the default deadline in seconds."""

    def __init__(self, target: str = DEFAULT_TARGET, *, application: str | None = None,
                 timeout: float | None = None) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.SpecDecodeStub(self.channel)
        self.metadata = (("application", application),) if application else ()
        self.timeout = timeout

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 traceparent: str | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Stream a completion (keyword arguments as `make_request`). Breaking out of the loop
        or closing the generator cancels the call, which aborts the request on the server."""
        return self.stream(make_request(prompt, **kwargs), timeout=timeout, traceparent=traceparent)

    def chat(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None,
             traceparent: str | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Stream the assistant's next turn of a conversation ({"role", "content"} messages,
        rendered by the model's chat template on the server)."""
        return self.stream(make_request(list(messages), **kwargs), timeout=timeout, traceparent=traceparent)

    def stream(self, request: pb.GenerateRequest, *, timeout: float | None = None,
               traceparent: str | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream; the trace context is the span active when iteration starts (or `traceparent`)."""
        metadata = self.metadata + trace_metadata(traceparent)
        call = self.stub.Generate(request, timeout=timeout or self.timeout, metadata=metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has finished

    def model_info(self, *, timeout: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def wait_ready(self, timeout: float = 60.0) -> pb.ModelInfo:
        """Poll GetModelInfo until the deployment answers (or raise the last error)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.model_info(timeout=5.0)
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpecDecodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_stats(last: pb.GenerateResponse, elapsed_s: float, first_token_s: float | None) -> str:
    """Human-readable usage and speculation stats of a finished stream."""
    u, s = last.usage, last.speculation
    lines = [
        f"finish_reason={pb.FinishReason.Name(last.finish_reason)} prompt_tokens={u.prompt_tokens} "
        f"completion_tokens={u.completion_tokens} cached_prompt_tokens={u.cached_prompt_tokens}",
        f"time: first token {first_token_s * 1e3:.1f} ms, total {elapsed_s * 1e3:.1f} ms"
        if first_token_s is not None else f"time: total {elapsed_s * 1e3:.1f} ms",
    ]
    if s.enabled:
        lines.append(
            f"speculation: drafted {s.num_draft_tokens}, accepted {s.num_accepted_tokens} "
            f"(acceptance {s.acceptance_rate:.1%}), {s.num_verify_steps} verify steps, "
            f"mean accepted length {s.mean_accepted_length:.2f}, draft {s.draft_time_s * 1e3:.1f} ms, "
            f"verify {s.verify_time_s * 1e3:.1f} ms"
        )
    else:
        lines.append("speculation: off")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream a completion from the SpecDecode gRPC service.")
    parser.add_argument("prompt", nargs="?", default="def fib(n):", help="prompt text")
    parser.add_argument("--token-ids", help="send comma-separated token ids instead of text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user's chat message (rendered by the model's chat template)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-spec", action="store_true", help="turn speculation off for this request")
    parser.add_argument("--k", type=int, default=None, help="cap on tokens drafted per step")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--application", default=None, help="Serve application name (several apps only)")
    parser.add_argument("--info", action="store_true", help="print the model info and exit")
    parser.add_argument("--traceparent", default=None,
                        help="W3C traceparent (00-<trace id>-<span id>-<flags>) the server's spans join")
    args = parser.parse_args(argv)
    if args.traceparent is not None and not TRACEPARENT_RE.match(args.traceparent):
        parser.error(f"--traceparent must look like 00-<32 hex>-<16 hex>-<2 hex>, got {args.traceparent!r}")

    with SpecDecodeClient(args.target, application=args.application, timeout=args.timeout) as client:
        try:
            if args.info:
                print(client.model_info())
                return 0
            prompt: str | list = (
                [int(t) for t in args.token_ids.split(",")] if args.token_ids
                else [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
            )
            start = time.perf_counter()
            first: float | None = None
            last: pb.GenerateResponse | None = None
            if isinstance(prompt, str):
                sys.stdout.write(prompt)
            for chunk in client.generate(
                prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, max_speculative_tokens=args.k,
                speculation="off" if args.no_spec else "default", traceparent=args.traceparent,
            ):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - start
                # Without a tokenizer the server sends no text; show the token ids instead.
                sys.stdout.write(chunk.text if chunk.text or not chunk.token_ids
                                 else "".join(f" {t}" for t in chunk.token_ids))
                sys.stdout.flush()
                last = chunk
            elapsed = time.perf_counter() - start
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    if last is not None:
        print(format_stats(last, elapsed, first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
