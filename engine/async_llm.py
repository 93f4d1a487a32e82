"""`AsyncLLM`: a streaming engine for serving. The engine loop runs in its own thread.

All engine calls happen on that thread (the core is not thread-safe); the event loop talks to it
through a command queue and gets outputs back through per-request asyncio queues. `abort`
frees the request's KV blocks at the thread's next turn (before the next step).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator

from engine.errors import EngineError, InvalidRequestError
from engine.llm import LLM
from engine.outputs import RequestOutput, RequestState
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine")


class EngineDeadError(EngineError, RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncLLM:
    def __init__(self, model: str, **llm_kwargs) -> None:
        self.llm = LLM(model, **llm_kwargs)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestState]] = {}
        self._ids = itertools.count()
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream incremental outputs. Bad input raises InvalidRequestError before anything runs.
        Cancelling the consumer (or breaking out) aborts the request and frees its blocks."""
        if self._stopped:
            raise EngineDeadError("the engine loop has stopped")
        params = sampling_params or SamplingParams()
        text, ids = self.llm.encode(prompt)
        self.engine.validate_request(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q, RequestState(rid, text, ids, params, self.tokenizer))
        self._send(("add", rid, ids, params))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send(("abort", rid))

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, as `generate` will see it."""
        return self.llm.encode(prompt)

    def abort(self, request_id: str) -> None:
        """Finish a request now; its KV blocks are freed before the engine's next step."""
        self._send(("abort", request_id))

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

    # --- engine thread ----------------------------------------------------------------------
    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q, _ = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, ids, params = cmd
                try:
                    self.engine.add_request(rid, ids, params)
                except EngineError as e:
                    self._deliver(rid, e)
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
            elif kind == "call":
                _, fn, args, loop, fut = cmd
                try:
                    result = fn(*args)
                except Exception as e:  # noqa: BLE001 - handed back to the caller
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, result)

    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._snapshot = self.engine.stats()
                self._wake.wait(timeout=0.5)
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
                entry = self._streams.get(out.request_id)
                if entry is None:
                    if not out.finished:
                        self.engine.abort_request(out.request_id)
                    continue
                ro, stop_hit = entry[2].process(out)
                if stop_hit:
                    self.engine.abort_request(out.request_id)
                if ro.finished:
                    final.append(ro)
                else:
                    self._deliver(out.request_id, ro)
            try:
                self.engine.finish_step()
            except Exception:  # noqa: BLE001 - a failed draft only loses this step's drafts
                logger.error("drafting failed:\n%s", traceback.format_exc())
                for r in self.engine.live_requests():
                    r.spec_token_ids, r.spec_probs = [], None
            for ro in final:
                self._deliver(ro.request_id, ro)
            self._snapshot = self.engine.stats()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
