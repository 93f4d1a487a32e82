"""`AsyncLLM`: a streaming engine for serving. The engine loop runs in its own thread.

All engine calls happen on that thread (the core is not thread-safe); the event loop talks to it
through a command queue and gets outputs back through per-request asyncio queues. `abort`
frees the request's KV blocks at the thread's next turn (before the next step). Text prompts are
tokenized in a worker thread, never on the event loop that serves the other streams, after a
length check that needs no tokenizer (`max_prompt_chars`).

A request id names one engine request until the engine thread has let go of it: a stream that is
closed early keeps its id reserved until its abort is processed, so a new request with the same
id can never receive the old one's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.errors import EngineError, EngineOverloadedError, InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import EngineOutput
from engine.outputs import RequestOutput, RequestState
from engine.sampling_params import SamplingParams
from engine.token_healing import wants_healing

logger = logging.getLogger("engine")


class EngineDeadError(EngineError, RuntimeError):
    """The engine thread has stopped; no request can be served."""


# Normalization (NFKC, a SentencePiece word marker) can make a token stand for more characters
# of the input than its own string has; this margin keeps `max_prompt_chars` a safe bound.
CHARS_PER_TOKEN_MARGIN = 2


def max_prompt_chars(tokenizer, max_prompt_tokens: int) -> int:
    """The most characters a text prompt of at most `max_prompt_tokens` tokens can have.

    Every token stands for at most `longest` characters (its longest vocabulary string: for a
    byte-level BPE one character per byte, and a character is at least one byte), so a text
    longer than max_prompt_tokens * longest * CHARS_PER_TOKEN_MARGIN cannot fit, and is refused
    before it is tokenized. Example: 1023 tokens, longest token 16 -> 32,736 characters.
    """
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_prompt_tokens * max(longest, 1) * CHARS_PER_TOKEN_MARGIN


@dataclass
class _Stream:
    """The event-loop side of one request: where its outputs go, and whether its consumer left."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    state: RequestState
    closing: bool = field(default=False)


class AsyncLLM:
    def __init__(self, model: str, **llm_kwargs) -> None:
        self.llm = LLM(model, **llm_kwargs)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._longest_token: int | None = None  # max_prompt_chars per token, computed once
        self._pending_imports: list[tuple[str, object, bool]] = []  # handoffs waiting for free KV blocks
        self._stopped = False
        self._snapshot: dict = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- public API -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        export_after_prefill: bool = False,
        handoff=None,
        num_emitted_chars: int = 0,
        with_drafter_state: bool = True,
        output_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream incremental outputs. Bad input raises InvalidRequestError before anything runs.
        Cancelling the consumer (or breaking out) aborts the request and frees its blocks.

        Prefill/decode disaggregation: with `export_after_prefill`, the stream yields the first
        token(s), then ends with an output whose finish_reason is "handoff" and whose `handoff`
        the decode side imports (unless the request finished on its first token). With
        `output_token_ids` the request resumes after those tokens, made by an engine that was lost
        (they are prefilled with the prompt; `num_emitted_chars` characters of their text were
        delivered, so the stream yields what follows). With `handoff`
        (an `engine.handoff.Handoff` for this prompt), the request continues from it: its first
        tokens (and `num_emitted_chars` characters of their text) were already delivered, so the
        stream yields what follows. An import waits for free KV blocks like a new request;
        `with_drafter_state=False` (an ablation) exports, or imports, the target's KV only.
        `SamplingParams.token_healing` heals a text prompt (the same ids on both sides of a
        handoff); a prompt given as token ids runs as it is, with the params' first-token
        constraint and healed prefix if a caller healed it (`heal_async`)."""
        if self._stopped:
            raise EngineDeadError("the engine loop has stopped")
        params = sampling_params or SamplingParams()
        text, ids = await self.encode_async(prompt)
        ids, params = await self.heal_async(text, ids, params)
        self.engine.validate_request(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        state = RequestState(rid, text, ids, params, self.tokenizer)
        if handoff is not None:
            if list(handoff.prompt_token_ids) != list(ids):
                raise InvalidRequestError("handoff: its prompt is not this request's prompt")
            state.skip(list(handoff.output_token_ids), num_emitted_chars)
        elif output_token_ids:
            state.skip(list(output_token_ids), num_emitted_chars)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), state)
        self._streams[rid] = stream
        if handoff is not None:
            self._send(("import", rid, handoff, with_drafter_state))
            handoff = None  # the engine thread holds it until imported; this frame lives on with the stream
        else:
            self._send(("add", rid, ids, params, export_after_prefill, with_drafter_state, output_token_ids))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped the request
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if finished:
                self._streams.pop(rid, None)
            else:
                # The id stays reserved until the engine thread has aborted the request: the
                # step running now may still produce outputs for it.
                stream.closing = True
                self._send(("abort", rid, stream))

    async def encode_async(self, prompt: str | list[int], max_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """`encode` in the tokenizer thread. A text that cannot fit in `max_prompt_tokens` (default:
        the engine's max_model_len - 1) is refused before tokenization (`max_prompt_chars`)."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            limit = max_prompt_tokens or self.engine.max_model_len - 1
            if len(prompt) > self.max_prompt_chars(limit):
                raise InvalidRequestError(
                    f"prompt has {len(prompt)} characters; at most {limit} tokens are accepted, which no "
                    f"text over {self.max_prompt_chars(limit)} characters fits in"
                )
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.llm.encode, prompt)
        return self.llm.encode(prompt)

    async def heal_async(
        self, text: str | None, ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """`LLM.heal` (token healing), in the tokenizer thread when there is healing to do (its
        first use decodes the whole vocabulary once)."""
        if not wants_healing(text, params):
            return ids, params
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, self.llm.heal, text, ids, params
        )

    def max_prompt_chars(self, max_prompt_tokens: int) -> int:
        if self._longest_token is None:
            self._longest_token = max_prompt_chars(self.tokenizer, 1)
        return self._longest_token * max_prompt_tokens

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, as `generate` will see it before token healing (`heal_async`)."""
        return self.llm.encode(prompt)

    def abort(self, request_id: str) -> None:
        """Finish a request now; its KV blocks are freed before the engine's next step, and its
        stream ends with finish_reason "abort"."""
        self._send(("abort", request_id, None))

    def stats(self) -> dict:
        """Engine counters as of the last step (thread-safe snapshot)."""
        return dict(self._snapshot)

    async def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine holds no request, then return its stats."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            s = await self.call(self.engine.stats)
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return s
            await asyncio.sleep(0.01)
        return await self.call(self.engine.stats)

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine thread (between steps) and return its result."""
        fut = asyncio.get_running_loop().create_future()
        self._send(("call", fn, args, asyncio.get_running_loop(), fut))
        return await fut

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # --- engine thread ----------------------------------------------------------------------
    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is not None and not stream.closing:
            if not _call_soon(stream.loop, stream.queue.put_nowait, item):
                # Its consumer's event loop is closed: nobody reads the stream any more.
                self.engine.abort_request(rid)
                self._release(rid, stream)

    def _abort(self, rid: str, closing: _Stream | None) -> None:
        """Abort in the engine, then let go of the id: a stream its consumer closed is dropped;
        one still read (`AsyncLLM.abort`) gets a final output with finish_reason "abort"."""
        request = self.engine.scheduler.requests.get(rid)
        self.engine.abort_request(rid)
        stream = self._streams.get(rid)
        if stream is None:
            return
        if closing is not None:
            # here, not on its loop: a loop that is closing (asyncio.run returning) may take the
            # callback and close without running it, and the stream would stay for good
            self._release(rid, closing)
            return
        if request is not None:
            out = EngineOutput(rid, [], "abort", request.num_prompt_tokens, request.num_output_tokens,
                               request.num_cached_tokens, request.spec_stats)
            self._deliver(rid, stream.state.process(out)[0])
        elif any(pending[0] == rid for pending in self._pending_imports):  # a handoff waiting for blocks or a slot
            self._pending_imports = [pending for pending in self._pending_imports if pending[0] != rid]
            state = stream.state
            out = EngineOutput(rid, [], "abort", len(state.prompt_token_ids), len(state.token_ids))
            self._deliver(rid, state.process(out)[0])

    def _release(self, rid: str, stream: _Stream) -> None:
        """Forget a closed stream (only that one, never a newer holder: `generate` refuses an id
        while a stream holds it, so none can come between the check and the delete)."""
        if self._streams.get(rid) is stream:
            del self._streams[rid]

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, ids, params, export, with_state, output = cmd
                try:
                    self.engine.add_request(rid, ids, params, export_after_prefill=export,
                                            export_drafter_state=with_state, output_token_ids=output)
                except EngineError as e:
                    self._deliver(rid, e)
            elif kind == "import":
                self._pending_imports.append((cmd[1], cmd[2], cmd[3]))
            elif kind == "abort":
                self._abort(cmd[1], cmd[2])
            elif kind == "call":
                _, fn, args, loop, fut = cmd
                try:
                    result = fn(*args)
                except Exception as e:  # noqa: BLE001 - handed back to the caller
                    _call_soon(loop, _set_exception, fut, e)
                else:
                    _call_soon(loop, _set_result, fut, result)

    def _import_pending(self) -> None:
        """Import the handoffs that fit now, oldest first; the rest wait for blocks to free up."""
        waiting = []
        for rid, handoff, with_state in self._pending_imports:
            stream = self._streams.get(rid)
            if stream is None or stream.closing or waiting:
                if stream is not None and not stream.closing:
                    waiting.append((rid, handoff, with_state))
                continue
            try:
                self.engine.import_handoff(rid, handoff, with_drafter_state=with_state)
            except EngineOverloadedError:
                waiting.append((rid, handoff, with_state))
            except EngineError as e:
                self._deliver(rid, e)
        self._pending_imports = waiting

    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if self._pending_imports:
                self._import_pending()
            if not self.engine.has_unfinished_requests():
                self._snapshot = self.engine.stats()
                self._wake.wait(timeout=0.01 if self._pending_imports else 0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.execute_step()
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
                logger.error("engine step failed:\n%s", traceback.format_exc())
                for r in self.engine.live_requests():
                    self.engine.abort_request(r.request_id)
                    self._deliver(r.request_id, EngineError(f"engine step failed: {e!r}"))
                continue
            # Tokens go out before drafting for the next step. A request's final output waits
            # until the step is finished, so step listeners (tracing) see its last step first.
            final = []
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None or stream.closing:  # its consumer left; the abort is queued
                    if not out.finished and stream is None:
                        self.engine.abort_request(out.request_id)
                    continue
                ro, stop_hit = stream.state.process(out)
                if stop_hit:
                    self.engine.abort_request(out.request_id)
                if ro.finished:
                    final.append(ro)
                else:
                    self._deliver(out.request_id, ro)
            try:
                self.engine.finish_step()  # a drafting failure is caught (and logged) by the engine
            except Exception:  # noqa: BLE001 - a step listener (metrics, tracing) failed: keep serving
                logger.error("step listener failed:\n%s", traceback.format_exc())
            for rid, handoff in self.engine.take_handoffs().items():
                stream = self._streams.get(rid)
                if stream is not None and not stream.closing:
                    ro, _ = stream.state.process(EngineOutput(rid, [], "handoff", len(handoff.prompt_token_ids),
                                                              len(handoff.output_token_ids)))
                    ro.handoff = handoff
                    final.append(ro)
            for ro in final:
                self._deliver(ro.request_id, ro)
            self._snapshot = self.engine.stats()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """`loop.call_soon_threadsafe(fn, *args)` from the engine thread; False when the loop is
    closed (a consumer that left with its loop, e.g. `asyncio.run` returning): the engine thread
    must outlive its consumers."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
