"""Token healing (engine/token_healing.py): which prompt token it drops and which first tokens it
allows, against a scan of the vocabulary; the model runner's first-token mask (greedy, sampled,
next to requests without it, with speculation); the edge's text (the dropped token's text is the
prompt's, not output, and no stop string matches in it), on one engine and across a handoff;
the gRPC and HTTP fields. A tiny Llama with a byte-level BPE trained here on code, which (like
models/target's) merges a newline with the indentation that follows it."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model

from engine import LLM, AsyncLLM, InvalidRequestError, SamplingParams, SpeculativeConfig
from engine.llm_engine import EngineOutput
from engine.model_runner import constrain_first_tokens
from engine.outputs import RequestState
from engine.token_healing import apply_token_healing, heal_prompt, token_texts

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS = [
    f"def f{i}(n):\n    if n < {i}:\n        return n\n    return f(n - 1) + {i}\n\n" for i in range(50)
]
PROMPT = "def f(n):\n    return n\n"  # ends with a lone "\n" token
OTHER_PROMPT = "def g(n):\n    return"
INDENT_PROMPT = "def f(n):\n  "  # ends with "\n  ", the start of "\n   " and "\n       "
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HEAL = dataclasses.replace(GREEDY, token_healing=True)


def save_code_tokenizer(path: str) -> None:
    """A byte-level BPE of 300 tokens (<s> = 0, </s> = 1) that prepends <s>: "\\n    " is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    ).save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("token_healing")
    target = str(root / "target")
    save_code_tokenizer(target)
    save_tiny_model(target, "llama", vocab_size=300, bos_token_id=0, eos_token_id=1)
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    return {"target": target, "close": close}


@pytest.fixture(scope="module")
def llm(models) -> LLM:
    return LLM(models["target"], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def starting_with(tokenizer, prefix: str) -> list[int]:
    """The reference: a scan of every non-special token's decoded text."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special and tokenizer.decode([i]).startswith(prefix)]


def assert_text_consistent(out, tokenizer) -> None:
    """The prompt as written + the output text = the healed prompt's and the output's tokens
    decoded together (but for an incomplete character at the end, which the edge holds back)."""
    whole = tokenizer.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=True)
    text = out.prompt + out.text
    assert whole.startswith(text) and set(whole[len(text) :]) <= {"\ufffd"}, (whole, text)


# --- heal_prompt -------------------------------------------------------------------------------
def test_trailing_newline_is_healed_to_the_tokens_that_start_with_it(tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["Ġn", "Ċ"] and ids[0] == tokenizer.bos_token_id
    healed = heal_prompt(tokenizer, ids)
    assert healed.token_ids == ids[:-1] and healed.prefix_text == "\n"
    assert healed.first_token_ids == starting_with(tokenizer, "\n")
    assert ids[-1] in healed.first_token_ids
    assert tokenizer.convert_tokens_to_ids("ĊĠĠĠ") in healed.first_token_ids
    assert token_texts(tokenizer) is token_texts(tokenizer)  # one decode of the vocabulary per tokenizer


def test_prompts_healing_cannot_change_stay_as_they_are(tokenizer):
    texts = token_texts(tokenizer).texts
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    # a last token no other token's text starts with
    lone = next(
        i
        for i in range(2, len(tokenizer))
        if texts[i] and "\ufffd" not in texts[i] and starting_with(tokenizer, texts[i]) == [i]
    )
    # a byte of a multi-byte character: its text alone is not clean
    partial = next(i for i in range(2, len(tokenizer)) if "\ufffd" in texts[i])
    start = tokenizer.encode("def")
    for ids in (
        start + [lone],
        start + [partial],
        [bos, newline],
        [newline],
        [bos],
        start + [newline, eos],
        [],
    ):
        assert heal_prompt(tokenizer, ids) == (ids, None, ""), tokenizer.convert_ids_to_tokens(ids)


def test_healing_applies_to_text_prompts_that_ask_for_it_on_a_copy(tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert apply_token_healing(tokenizer, PROMPT, ids, GREEDY) == (ids, GREEDY)  # not asked
    assert apply_token_healing(tokenizer, None, ids, HEAL) == (ids, HEAL)  # token ids: sent as they are
    healed_ids, params = apply_token_healing(tokenizer, PROMPT, ids, HEAL)
    assert healed_ids == ids[:-1] and params.first_token_ids == starting_with(tokenizer, "\n")
    assert params.healed_prefix == "\n" and params.max_tokens == HEAL.max_tokens
    assert HEAL.first_token_ids is None and HEAL.healed_prefix == ""  # the caller's params are untouched
    assert apply_token_healing(tokenizer, PROMPT, healed_ids, params) == (healed_ids, params)  # healed once
    unhealable = tokenizer.encode("def")
    assert apply_token_healing(tokenizer, "def", unhealable, HEAL) == (unhealable, HEAL)


@pytest.mark.skipif(
    not (REPO_ROOT / "models" / "target" / "tokenizer.json").is_file(), reason="no shipped tokenizer"
)
def test_shipped_tokenizer_heals_a_docstring_newline():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REPO_ROOT / "models" / "target"))
    ids = tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    healed = heal_prompt(tokenizer, ids)
    assert healed.token_ids == ids[:-1] and healed.prefix_text == "\n"
    assert tokenizer.convert_tokens_to_ids("ĊĠĠĠ") in healed.first_token_ids
    assert healed.first_token_ids == starting_with(tokenizer, "\n")


def test_sampling_params_check_the_healing_fields(llm):
    with pytest.raises(InvalidRequestError, match="token_healing must be true or false"):
        SamplingParams(token_healing="yes")
    with pytest.raises(InvalidRequestError, match="first_token_ids must be None or a non-empty list"):
        SamplingParams(first_token_ids=[])
    with pytest.raises(InvalidRequestError, match=r"\[-1\]"):
        SamplingParams(first_token_ids=[3, -1])
    assert "first_token_ids" not in repr(SamplingParams(first_token_ids=list(range(200))))
    with pytest.raises(
        InvalidRequestError, match=r"first_token_ids \[300\] are outside the vocabulary \[0, 299\]"
    ):
        llm.generate([[0, 5]], SamplingParams(first_token_ids=[2, 300]))


# --- the mask ----------------------------------------------------------------------------------
def test_mask_covers_the_first_row_of_each_constrained_request_only():
    def scheduled(drafts: int, allowed: list[int] | None, num_outputs: int = 0):
        request = SimpleNamespace(
            sampling_params=SamplingParams(first_token_ids=allowed), num_output_tokens=num_outputs
        )
        return SimpleNamespace(request=request, spec_token_ids=[7] * drafts)

    # rows: request 0 -> 0..2, request 1 -> 3, request 2 -> 4..5, request 3 -> 6
    sampling = [
        scheduled(2, None),
        scheduled(0, [1, 4]),
        scheduled(1, [0, 2, 9]),
        scheduled(0, [3], num_outputs=1),
    ]
    logits = torch.randn(7, 10)
    before = logits.clone()
    constrain_first_tokens(sampling, logits)
    for row, allowed in ((3, [1, 4]), (4, [0, 2, 9])):
        assert torch.equal(logits[row, allowed], before[row, allowed])
        others = [t for t in range(10) if t not in allowed]
        assert torch.isneginf(logits[row, others]).all()
    untouched = [0, 1, 2, 5, 6]
    assert torch.equal(logits[untouched], before[untouched])
    plain = torch.randn(3, 10)
    copy = plain.clone()
    constrain_first_tokens([scheduled(0, None), scheduled(1, [2], num_outputs=3)], plain)
    assert torch.equal(plain, copy)


def test_greedy_healing_constrains_the_first_token_and_keeps_the_text_consistent(llm, tokenizer):
    ids = tokenizer.encode(PROMPT)
    healed = heal_prompt(tokenizer, ids)
    allowed = set(healed.first_token_ids)
    # Negative control: unconstrained, this model does not continue the healed prompt with a newline.
    plain = llm.generate([healed.token_ids], GREEDY)[0]
    assert plain.token_ids[0] not in allowed
    out = llm.generate(PROMPT, HEAL)[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == healed.token_ids
    assert out.token_ids[0] in allowed and len(out.token_ids) == GREEDY.max_tokens
    assert out.text == tokenizer.decode(out.token_ids)[len("\n") :]  # the newline is the prompt's
    assert_text_consistent(out, tokenizer)
    # the engine alone: the healed ids with the constraint give the same tokens
    constrained = dataclasses.replace(GREEDY, first_token_ids=healed.first_token_ids)
    assert llm.generate([healed.token_ids], constrained)[0].token_ids == out.token_ids
    # without the flag nothing changes
    off = llm.generate(PROMPT, GREEDY)[0]
    assert off.prompt_token_ids == ids and off.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    assert off.text == tokenizer.decode(off.token_ids)
    assert_no_leaked_blocks(llm.engine)


def test_mask_in_a_batch_of_greedy_sampled_and_unhealed_requests(llm, tokenizer):
    allowed = set(heal_prompt(tokenizer, tokenizer.encode(PROMPT)).first_token_ids)
    sampled = [dataclasses.replace(HEAL, temperature=1.0, seed=seed) for seed in range(4)]
    prompts = [PROMPT, OTHER_PROMPT, *[PROMPT] * len(sampled), PROMPT]
    params = [HEAL, GREEDY, *sampled, dataclasses.replace(HEAL, temperature=0.8, top_k=5, seed=9)]
    batch = llm.generate(prompts, params)
    for out, p in zip(batch, params, strict=True):
        if p.token_healing:
            assert out.token_ids[0] in allowed
            assert_text_consistent(out, tokenizer)
        # a request's tokens do not depend on the others of the batch (CPU, float32, no speculation)
        assert out.token_ids == llm.generate(out.prompt, p)[0].token_ids
    assert batch[1].prompt_token_ids == tokenizer.encode(OTHER_PROMPT)
    assert_no_leaked_blocks(llm.engine)


@pytest.mark.parametrize("method", ["ngram", "draft", "tree"])
def test_speculative_greedy_output_equals_non_speculative(models, llm, tokenizer, method):
    tree = dict(tree_nodes=8, tree_width=2, tree_depth=4) if method == "tree" else {}
    spec = SpeculativeConfig(
        method="ngram" if method == "ngram" else "draft",
        model=None if method == "ngram" else models["close"],
        num_speculative_tokens=4,
        adaptive=False,
        **tree,
    )
    fast = LLM(models["target"], dtype="float32", device="cpu", speculative=spec)
    params = dataclasses.replace(HEAL, max_tokens=24)
    prompts = [PROMPT, OTHER_PROMPT, PROMPT]
    all_params = [
        params,
        dataclasses.replace(params, token_healing=False),
        dataclasses.replace(params, temperature=1.0, seed=1),
    ]
    outs = fast.generate(prompts, all_params)
    expected = llm.generate(prompts[:2], all_params[:2])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in expected]
    assert fast.engine.stats()["spec"]["num_draft_tokens"] > 0  # speculation ran
    allowed = set(heal_prompt(tokenizer, tokenizer.encode(PROMPT)).first_token_ids)
    assert outs[0].token_ids[0] in allowed and outs[2].token_ids[0] in allowed
    assert_no_leaked_blocks(fast.engine)


# --- the edge's text -------------------------------------------------------------------------
class PieceTokenizer:
    """decode: the pieces of the ids, joined."""

    PIECES = ["\n  ", "x", "\n", "y"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


def test_stop_string_equal_to_the_healed_prefix_does_not_match_in_it():
    params = SamplingParams(max_tokens=10, stop=["\n"], first_token_ids=[0, 2], healed_prefix="\n")
    state = RequestState("r", "a:\n", [5], params, PieceTokenizer())
    texts = []
    for token in (0, 1, 2, 3):
        out, stop_hit = state.process(EngineOutput("r", [token]))
        texts.append(out.delta_text)
        if out.finished:
            break
    assert texts == ["  ", "x", ""] and out.text == "  x" and stop_hit and out.finish_reason == "stop"
    assert out.token_ids == [0, 1, 2]
    # a handoff's continuation: the first token and the text sent with it come from the exporter
    state = RequestState("d", "a:\n", [5], params, PieceTokenizer())
    state.skip([0], num_emitted_chars=2)
    out, _ = state.process(EngineOutput("d", [1, 3]))
    assert out.text == "  xy" and out.delta_text == "xy"


def test_stop_string_equal_to_the_healed_prefix_on_the_engine(llm, tokenizer):
    prefix = heal_prompt(tokenizer, tokenizer.encode(INDENT_PROMPT)).prefix_text
    assert prefix == "\n  "
    whole = llm.generate(INDENT_PROMPT, HEAL)[0]
    assert tokenizer.decode(whole.token_ids[:1]).startswith(prefix)
    expected = whole.text.split(prefix)[0]
    assert expected  # (else this model's output could not tell a stop in the prefix from one after it)
    out = llm.generate(INDENT_PROMPT, dataclasses.replace(HEAL, stop=[prefix]))[0]
    assert out.text == expected and out.finish_reason == ("stop" if prefix in whole.text else "length")


def test_handoff_heals_the_same_prompt_on_both_sides(models, llm):
    params = dataclasses.replace(HEAL, max_tokens=16)
    expected = llm.generate(PROMPT, params)[0]

    async def run() -> tuple[str, list[int], list[int]]:
        prefill = AsyncLLM(models["target"], dtype="float32", device="cpu")
        decode = AsyncLLM(models["target"], dtype="float32", device="cpu")
        try:
            text, tokens, handoff = "", [], None
            async for out in prefill.generate(PROMPT, params, export_after_prefill=True):
                text += out.delta_text
                tokens.extend(out.delta_token_ids)
                handoff = out.handoff
            assert handoff is not None and list(handoff.prompt_token_ids) == expected.prompt_token_ids
            prompt_ids = []
            async for out in decode.generate(PROMPT, params, handoff=handoff, num_emitted_chars=len(text)):
                text += out.delta_text
                tokens.extend(out.delta_token_ids)
                prompt_ids = out.prompt_token_ids
            return text, tokens, prompt_ids
        finally:
            prefill.shutdown()
            decode.shutdown()

    text, tokens, prompt_ids = asyncio.run(run())
    assert tokens == expected.token_ids and text == expected.text and prompt_ids == expected.prompt_token_ids
    assert_text_consistent(
        SimpleNamespace(prompt=PROMPT, prompt_token_ids=prompt_ids, token_ids=tokens, text=text),
        llm.tokenizer,
    )


# --- serving fields ------------------------------------------------------------------------------
def test_grpc_and_http_requests_carry_token_healing(llm, tokenizer):
    from deployments.openai_api import CompletionRequest, generate_request
    from deployments.replica import SpecDecodeServer
    from protos.specdecode.v1 import specdecode_pb2 as pb

    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": PROMPT, "specdecode": {"token_healing": True}}
    )
    request = generate_request(body, PROMPT)
    assert request.token_healing and not pb.GenerateRequest().token_healing

    async def encode_async(prompt, max_prompt_tokens):
        return llm.encode(prompt)

    async def heal_async(text, ids, params):
        return llm.heal(text, ids, params)

    replica = SimpleNamespace(
        config=SimpleNamespace(max_tokens=64, default_max_tokens=16, model="m"),
        vocab_size=300,
        has_drafter=False,
        max_prompt_tokens=64,
        llm=SimpleNamespace(encode_async=encode_async, heal_async=heal_async),
    )
    replica.sampling_kwargs = lambda r: SpecDecodeServer.sampling_kwargs(replica, r)
    ids, params = asyncio.run(SpecDecodeServer.translate(replica, request))
    healed = heal_prompt(tokenizer, tokenizer.encode(PROMPT))
    assert ids == healed.token_ids and params.token_healing
    assert params.first_token_ids == healed.first_token_ids and params.healed_prefix == "\n"
    as_ids = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=tokenizer.encode(PROMPT)), token_healing=True
    )
    ids, params = asyncio.run(SpecDecodeServer.translate(replica, as_ids))
    assert ids == tokenizer.encode(PROMPT) and params.first_token_ids is None  # token ids: not healed


def test_sampled_first_token_follows_the_masked_distribution(models, llm, tokenizer):
    """The first tokens of N seeded requests against the target's distribution renormalized over
    the allowed tokens (transformers' logits). Each token's frequency must lie within 5 standard
    deviations (plus 1/N) of its probability: a correct sampler fails this with probability below
    1e-5 (normal approximation, a handful of tokens)."""
    import transformers

    healed = heal_prompt(tokenizer, tokenizer.encode(PROMPT))
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([healed.token_ids])).logits[0, -1]
    allowed = torch.tensor(healed.first_token_ids)
    probs = torch.zeros_like(logits)
    probs[allowed] = logits[allowed].softmax(dim=-1)
    n = 400
    params = [dataclasses.replace(HEAL, temperature=1.0, max_tokens=1, seed=seed) for seed in range(n)]
    counts = torch.zeros_like(logits)
    for out in llm.generate([PROMPT] * n, params):
        counts[out.token_ids[0]] += 1
    assert counts[allowed].sum() == n  # nothing outside the allowed tokens
    freq = counts / n
    bound = 5 * (probs * (1 - probs) / n).sqrt() + 1 / n
    assert ((freq - probs).abs() <= bound).all(), (freq[allowed], probs[allowed])
    assert probs.max() < 0.99  # (the distribution is not one token: the test can tell)
