"""`LLM`: offline batched generation over the engine core (vLLM-style API)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, RequestState
from engine.sampling_params import SamplingParams
from engine.token_healing import apply_token_healing


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    from engine.models.gguf_checkpoint import is_gguf, read_gguf

    if is_gguf(model_dir):
        return read_gguf(model_dir).tokenizer()
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


class LLM:
    """Generate from a Hugging Face-format checkpoint directory or a GGUF file.

    >>> llm = LLM(model="models/target")
    >>> llm.generate(["def fib(n):"], SamplingParams(max_tokens=64, temperature=0.0))[0].text
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        speculative: SpeculativeConfig | dict | None = None,
        tokenizer: str | None = None,
        **engine_kwargs,
    ) -> None:
        self.engine = LLMEngine(
            model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            speculative=speculative,
            **engine_kwargs,
        )
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine.grammars.tokenizer = self.tokenizer  # structured output compiles against it
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompts as token-id lists")
            if not prompt:
                raise InvalidRequestError("prompt is empty: give at least one character")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def heal(
        self, text: str | None, ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """The prompt ids and params a request runs with: with `params.token_healing` and a text
        prompt, healed on a copy of the params (`engine.token_healing.apply_token_healing`; the
        same ids for the same text, so both sides of a handoff agree); else as given."""
        return apply_token_healing(self.tokenizer, text, ids, params)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order. All prompts are validated before any runs.
        If a step raises, the requests still running are aborted (their blocks freed) before the
        exception propagates, so the engine stays usable. `SamplingParams.token_healing` heals
        text prompts; prompts given as token ids run as they are."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        encoded = []
        for prompt, sp in zip(prompts, params, strict=True):
            text, ids = self.encode(prompt)
            encoded.append((text, *self.heal(text, ids, sp)))
        for _, ids, sp in encoded:
            self.engine.validate_request(ids, sp)
        states: dict[str, RequestState] = {}
        order: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for text, ids, sp in encoded:
                rid = f"llm-{next(self._ids)}"
                states[rid] = RequestState(rid, text, ids, sp, self.tokenizer)
                order.append(rid)
                self.engine.add_request(rid, ids, sp)
            while len(final) < len(order):
                for out in self.engine.step():
                    ro, stop_hit = states[out.request_id].process(out)
                    if stop_hit:
                        self.engine.abort_request(out.request_id)
                    if ro.finished:
                        final[out.request_id] = ro
        finally:
            for rid in order:
                if rid not in final:
                    self.engine.abort_request(rid)
        return [final[rid] for rid in order]
