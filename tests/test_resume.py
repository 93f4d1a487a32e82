"""A request resumed after the tokens another engine already made (`output_token_ids`, what the
ingress sends when a replica is lost mid-stream): greedy output goes on exactly as the
undisturbed run, with speculation, a grammar and penalties too, and the text stream continues
after the characters already sent."""

from __future__ import annotations

import asyncio

import pytest
from helpers import assert_no_leaked_blocks, save_tiny_model
from test_serve_grpc import save_char_tokenizer

from engine import LLM, AsyncLLM, LLMEngine, SamplingParams, SpeculativeConfig, StructuredOutput
from engine.errors import InvalidRequestError

PROMPT = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = save_tiny_model(str(tmp_path_factory.mktemp("resume") / "m"), "llama")
    save_char_tokenizer(path)
    return path


def run_engine(engine: LLMEngine, prompt, params, output_token_ids=None) -> list[int]:
    engine.add_request("r", prompt, params, output_token_ids=output_token_ids)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert_no_leaked_blocks(engine)
    return out


@pytest.mark.parametrize("extra", [{}, {"presence_penalty": 0.5, "frequency_penalty": 0.2}], ids=["plain", "penalized"])
@pytest.mark.parametrize("method", [None, "ngram"])
def test_greedy_continuation_equals_the_undisturbed_run(model, method, extra):
    spec = None if method is None else SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False,
                                                         ngram_min=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **extra)
    whole = run_engine(LLMEngine(model, dtype="float32", device="cpu", speculative=spec), PROMPT, params)
    for cut in (1, 7, 23):
        rest = run_engine(LLMEngine(model, dtype="float32", device="cpu", speculative=spec), PROMPT, params,
                          output_token_ids=whole[:cut])
        assert whole[:cut] + rest == whole


def test_a_grammar_is_replayed_over_the_tokens_made(model):
    llm = LLM(model, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutput("regex", "[a-f]{5}-[0-9]{4}"))
    (whole,) = llm.generate(["id: "], params)
    engine = llm.engine
    prompt = llm.tokenizer.encode("id: ", add_special_tokens=False)
    rest = run_engine(engine, prompt, params, output_token_ids=whole.token_ids[:3])
    assert whole.token_ids[:3] + rest == whole.token_ids
    with pytest.raises(InvalidRequestError, match="not allowed by the grammar"):
        engine.add_request("bad", prompt, params, output_token_ids=llm.tokenizer.encode("zz", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match="output tokens already made"):
        engine.add_request("full", prompt, SamplingParams(max_tokens=2), output_token_ids=[40, 41])
    assert_no_leaked_blocks(engine)


def test_the_text_stream_goes_on_after_what_was_sent(model):
    """The resumed stream's text deltas are the undisturbed text after the characters sent."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def texts() -> tuple[str, str, list[int]]:
        llm = AsyncLLM(model, dtype="float32", device="cpu")
        try:
            whole, ids = "", []
            async for out in llm.generate("def f(x):", params):
                whole += out.delta_text
                ids = out.token_ids
            sent = whole[: len(whole) // 2]
            cut = len(sent)  # one character per token with this tokenizer
            rest = ""
            async for out in llm.generate("def f(x):", params, output_token_ids=ids[:cut], num_emitted_chars=len(sent)):
                rest += out.delta_text
                last = out
            assert last.token_ids == ids
            return whole, sent + rest, ids
        finally:
            llm.shutdown()

    whole, resumed, _ = asyncio.run(texts())
    assert resumed == whole
