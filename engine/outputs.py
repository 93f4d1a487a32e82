"""Edge of the engine: detokenization, stop strings, and the outputs users see.

The engine core produces token ids; this module turns them into incremental text, applies stop
strings (which need text) and builds `RequestOutput`s for `LLM` and `AsyncLLM`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import tokenizers
import tokenizers.decoders

from engine.llm_engine import EngineOutput
from engine.request import SpecStats
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine")


@dataclass
class RequestOutput:
    """A request's output so far. `token_ids`/`text` are cumulative; `delta_*` is what is new."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # Where the params ask for them (SamplingParams.logprobs): one per token of `token_ids` that
    # this engine made (cumulative) and of `delta_token_ids`; else None.
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    # Set on the last output of a request added with `export_after_prefill` that was handed off
    # (finish_reason "handoff"): everything another engine needs to continue it (engine/handoff.py).
    handoff: Any = None

    @property
    def spec_stats(self) -> dict:
        return self.metrics.get("spec", {})




class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids, holding back incomplete UTF-8 sequences.

    A tokenizer backed by Hugging Face `tokenizers` (every fast tokenizer) is decoded by its
    `DecodeStream`, which keeps its own short window in Rust: one call per push. Any other
    tokenizer decodes a short window here: the text of ids[prefix:] minus the text of
    ids[prefix:read] is new text. Example: ids [a, b, c], prefix 1, read 2 -> delta = dec([b, c])
    - dec([b]). Both give the same deltas (tests/test_detokenizer.py).
    """

    def __init__(self, tokenizer, stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend if stream and isinstance(backend, tokenizers.Tokenizer) else None
        self.stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True) if self.backend else None

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if self.stream is not None:
            if not new_ids:
                return ""
            delta = self.stream.step(self.backend, list(new_ids)) or ""
            if delta:  # the same offsets as the window decoder's, for flush()
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        dec = self.tokenizer.decode
        prefix_text = dec(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new_text = dec(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The text of the ids held back as an incomplete UTF-8 sequence, as the tokenizer decodes
        them ('\ufffd' for each byte that starts no complete character): at a request's end its
        text is then the whole decode of its ids, e.g. when max_tokens cut a character in two."""
        if self.read_offset == len(self.ids):
            return ""
        dec = self.tokenizer.decode
        prefix_text = dec(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new_text = dec(self.ids[self.prefix_offset :], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


class RequestState:
    """Per-request state at the edge: cumulative text and the stop-string check.

    A healed prompt (`SamplingParams.healed_prefix`, engine/token_healing.py) lost its last token,
    whose text the first output token(s) start with: that text is the prompt's, so it is cut from
    the start of the output text before stop strings are searched."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.unstripped_prefix = params.healed_prefix  # what of it the output text has not passed yet
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.full_text = ""
        self.num_emitted = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished = False

    def _new_text(self, new_ids: list[int]) -> str:
        """The text `new_ids` add to the output, less what is left of the healed prefix."""
        if self.detokenizer is None:
            return ""
        return self._strip_healed(self.detokenizer.push(new_ids))

    def _strip_healed(self, text: str) -> str:
        if self.unstripped_prefix and text:
            n = min(len(text), len(self.unstripped_prefix))
            if text[:n] != self.unstripped_prefix[:n]:
                # Only a tokenizer whose decoding of a token depends on its neighbours gets here
                # (the model runner allows no other first token): keep the text as it decodes.
                logger.warning(
                    "request %r: output %r does not start with the healed prompt's %r; not cut",
                    self.request_id,
                    text[:n],
                    self.unstripped_prefix[:n],
                )
                self.unstripped_prefix = ""
                return text
            self.unstripped_prefix = self.unstripped_prefix[n:]
            text = text[n:]
        return text

    def skip(self, token_ids: list[int], num_emitted_chars: int) -> None:
        """Take `token_ids` as already delivered by another engine (prefill/decode handoff): the
        text advances over them and the first `num_emitted_chars` characters count as sent."""
        self.token_ids.extend(token_ids)
        self.full_text += self._new_text(token_ids)
        self.num_emitted = min(num_emitted_chars, len(self.full_text))
        if self.first_token_time is None and token_ids:
            self.first_token_time = time.monotonic()

    def process(self, out: EngineOutput) -> tuple[RequestOutput, bool]:
        """Apply one engine output. Returns the RequestOutput and whether a stop string hit
        (the caller must then abort the request in the engine)."""
        now = time.monotonic()
        if self.first_token_time is None and out.new_token_ids:
            self.first_token_time = now
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        before = len(self.full_text)
        self.full_text += self._new_text(out.new_token_ids)
        finish_reason = out.finish_reason
        if finish_reason is not None and finish_reason != "handoff" and self.detokenizer is not None:
            # the request ends here (a handed-off one goes on elsewhere): its held-back bytes too
            self.full_text += self._strip_healed(self.detokenizer.flush())
        stop_hit = False
        stops = self.params.stop_strings
        longest = max((len(s) for s in stops), default=0)
        if stops and len(self.full_text) > before:
            start = max(0, before - longest + 1)
            hits = [i for s in stops if (i := self.full_text.find(s, start)) != -1]
            if hits:
                self.full_text = self.full_text[: min(hits)]
                stop_hit = finish_reason is None
                finish_reason = "stop"
        self.finished = finish_reason is not None
        # Hold back a tail that could still become a stop string, so streamed text never
        # has to be taken back.
        visible = len(self.full_text)
        if stops and not self.finished:
            visible = max(self.num_emitted, visible - longest + 1)
        delta = self.full_text[self.num_emitted : visible]
        self.num_emitted = visible
        metrics = {
            "arrival_time": self.arrival_time,
            "ttft_s": (self.first_token_time - self.arrival_time) if self.first_token_time else None,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_output_tokens": len(self.token_ids),
        }
        if self.finished:
            metrics["e2e_s"] = now - self.arrival_time
        stats: SpecStats | None = out.spec_stats
        if stats is not None:
            metrics["spec"] = stats.as_dict()
        return (
            RequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids,
                token_ids=list(self.token_ids),
                text=self.full_text[: self.num_emitted],
                delta_token_ids=list(out.new_token_ids),
                delta_text=delta,
                finished=self.finished,
                finish_reason=finish_reason,
                num_cached_tokens=out.num_cached_tokens,
                metrics=metrics,
                logprobs=None if self.logprobs is None else list(self.logprobs),
                delta_logprobs=None if self.logprobs is None else list(out.new_logprobs or []),
            ),
            stop_hit,
        )
