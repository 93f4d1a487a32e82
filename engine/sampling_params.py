"""Per-request sampling and speculation parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # alternatives per token (the OpenAI API's top_logprobs limit)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # tokens a request may bias (the OpenAI API's limit)
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 65_536


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (engine/structured_output.py): `kind` json_object (any
    JSON object; `spec` empty), json_schema (`spec`: the schema as JSON text), regex (`spec`: a
    regular expression, Rust regex syntax) or grammar (`spec`: a Lark grammar, or llama.cpp's
    GBNF). The output is the target's distribution restricted to what matches, speculation or not."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output: kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidRequestError(f"structured output: spec must be a string of at most "
                                      f"{MAX_STRUCTURED_SPEC_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"structured output: {self.kind} needs its {_SPEC_NAMES[self.kind]}")
        if self.kind == "json_schema":
            import json

            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequestError(f"structured output: the JSON schema is not JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("structured output: a JSON schema is an object (or true/false)")


_SPEC_NAMES = {"json_schema": "schema", "regex": "regular expression", "grammar": "grammar"}


@dataclass
class SamplingParams:
    """How to sample one request's tokens (vLLM names).

    temperature 0 means greedy. top_k 0 means off, top_p 1.0 means off. `seed` gives the
    request its own torch.Generator (one uniform per sampled token). Without speculation (an
    engine without a drafter, or `speculative=False` on the request) a seeded request's tokens are
    reproducible whatever else is batched with it and across preemptions, up to floating-point
    differences between batch shapes (exact on the CPU in float32; in bf16 or on a GPU a near-tie
    can flip). With speculation they follow the same distribution, but the drafter and the
    rejection sampler draw from the same generator, and which drafts a step verifies depends on the
    batch (token budget, adaptive policy): the tokens repeat only when the same requests run the
    same way (same engine configuration and arrivals, `adaptive=False`).
    `speculative` turns speculation off for this request when False; `num_speculative_tokens`
    caps k for this request (None: the engine's default; 0: no speculation either); on an engine
    that drafts token trees (`SpeculativeConfig.tree_nodes`), a request that sets it drafts a
    chain of at most that many tokens instead of a tree.

    `token_healing` (text prompts only; token-id prompts are sent as they are): when the prompt's
    last token is a prefix of longer tokens (code ending with "\n", which the tokenizer would
    merge with the next line's indentation), the edge drops it and the first generated token
    must start with its text (`engine.token_healing`). The output's `text` follows the prompt
    as written (it does not repeat the dropped token's text; stop strings are not searched in
    it); its `token_ids` are the generated tokens, the first of which repeats that text, and its
    `prompt_token_ids` are the healed prompt's. The edge sets the engine-level fields on a copy
    of the params: `first_token_ids`, the tokens a request's first output token may be (the
    model runner masks the others out, greedy or sampled), and `healed_prefix`, the text the
    edge strips from the start of the output.

    `logprobs` (None: none; 0..MAX_LOGPROBS): each output token comes with its log-probability
    and that many most likely alternatives (`RequestOutput.logprobs`), read from the target's
    logits in the step that verified the token: the model's log-softmax ("raw": before
    temperature, top-k and top-p; token healing's first-token constraint applied). A draft and
    the token a one-token step would compute at its position get the same logits bits (the
    engine's `exact` modes), so the values are the same with and without speculation. With
    `structured_output` they are those of the grammar-masked logits (tokens the grammar forbids
    have -inf).

    `presence_penalty`, `frequency_penalty` (OpenAI: [-2, 2]), `repetition_penalty` (vLLM and
    transformers: > 0, 1 = off), `logit_bias` ({token id: bias in [-100, 100]}) and `min_tokens`
    (no end of sequence or stop token before that many tokens) change the target's logits
    (engine/penalties.py), with speculation as without; log-probabilities are read after them
    ("processed" logits, before temperature, top-k and top-p).

    `structured_output` (a StructuredOutput): every output token is one the grammar allows
    there (engine/structured_output.py); the request stops when the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculative: bool = True
    num_speculative_tokens: int | None = None
    token_healing: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    first_token_ids: list[int] | None = field(default=None, repr=False)
    healed_prefix: str = ""
    _stop: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.num_speculative_tokens is not None and (
            not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0
        ):
            raise InvalidRequestError(
                f"num_speculative_tokens must be an integer >= 0 or None, got {self.num_speculative_tokens!r}"
            )
        self._check_processors()
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError(f"structured_output must be a StructuredOutput or None, got {self.structured_output!r}")
        if not isinstance(self.token_healing, bool):
            raise InvalidRequestError(f"token_healing must be true or false, got {self.token_healing!r}")
        if self.first_token_ids is not None:
            self.first_token_ids = list(self.first_token_ids)
            bad = [t for t in self.first_token_ids if not isinstance(t, int) or t < 0]
            if bad or not self.first_token_ids:
                raise InvalidRequestError(
                    f"first_token_ids must be None or a non-empty list of token ids >= 0, got "
                    f"{len(self.first_token_ids)} ids of which {bad[:5]!r} are not"
                )
        if not isinstance(self.healed_prefix, str):
            raise InvalidRequestError(f"healed_prefix must be a string, got {self.healed_prefix!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError(f"stop must be non-empty strings, got {self.stop!r}")
        self._stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 = off), got {r!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            bad = [(t, v) for t, v in self.logit_bias.items()
                   if isinstance(t, bool) or not isinstance(t, int) or t < 0
                   or isinstance(v, bool) or not isinstance(v, int | float) or not -100.0 <= v <= 100.0]
            if bad:
                raise InvalidRequestError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {bad[:3]}")

    @property
    def has_logit_processors(self) -> bool:
        """Penalties, biases or min_tokens apply to this request's logits (engine/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
