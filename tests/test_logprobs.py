"""Log-probabilities of the generated tokens (`SamplingParams.logprobs`): the target's log-softmax
at each token's position, as transformers computes it for the same sequence; the same values with
speculation (chains and token trees) as without, because a verified draft's logits are the bits a
one-token step computes; truncated with the tokens a stop condition cuts off."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import save_tiny_model

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

PROMPT = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]  # a repetition n-gram lookup drafts from
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "ngram_min": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("logprobs") / "m"), "llama")


def generate(model_dir: str, params: SamplingParams, **engine) -> tuple[list[int], list]:
    llm = LLM(model=model_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, **engine)
    (out,) = llm.generate([PROMPT], params)
    return out.token_ids, out.logprobs, llm


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives(model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    tokens, logprobs, _ = generate(model_dir, params)
    assert [lp.token_id for lp in logprobs] == tokens
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + tokens])).logits[0]
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)  # row j predicts tokens[j]
    for j, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(expected[j, tokens[j]].item(), abs=1e-4)
        values, ids = expected[j].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.top[0] == (lp.token_id, lp.logprob)  # greedy: the token is the most likely one
    none = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _, nothing, _ = generate(model_dir, none)
    assert nothing is None
    _, bare, _ = generate(model_dir, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0))
    assert len(bare) == 4 and all(lp.top == () for lp in bare)


@pytest.mark.parametrize("speculative", [NGRAM, {**NGRAM, "tree_nodes": 8, "tree_width": 2, "tree_depth": 4}],
                         ids=["chain", "tree"])
def test_logprobs_with_speculation_equal_those_without(model_dir, speculative):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    tokens, plain, _ = generate(model_dir, params)
    spec_tokens, spec, llm = generate(model_dir, params, speculative=speculative)
    assert llm.engine.spec_stats.num_accepted_tokens > 0  # drafts were verified and kept
    assert spec_tokens == tokens
    assert spec == plain  # the same floats: the verification's logits are the one-token step's bits


def test_a_stop_token_cuts_the_logprobs_with_the_tokens(model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    tokens, _, _ = generate(model_dir, params)
    stop = tokens[5]
    cut = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, stop_token_ids=[stop])
    for engine in ({}, {"speculative": NGRAM}):
        got, logprobs, _ = generate(model_dir, cut, **engine)
        assert got == tokens[: tokens.index(stop) + 1]
        assert [lp.token_id for lp in logprobs] == got


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_out_of_range_logprobs_are_refused(bad):
    with pytest.raises(InvalidRequestError, match="logprobs must be None or an integer in"):
        SamplingParams(logprobs=bad)


def test_a_tokens_text_and_bytes_are_its_own_even_inside_a_character():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.token_bytes import token_piece

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sat on the mat"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"],
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    the = tok.encode(" the")
    assert len(the) == 1 and token_piece(tok, the[0]) == (" the", b" the")
    pieces = [token_piece(tok, t) for t in tok.encode("é😀")]  # bytes the merges never joined
    assert b"".join(raw for _, raw in pieces) == "é😀".encode()
    assert all(text == raw.decode("utf-8", errors="replace") for text, raw in pieces)
    assert token_piece(tok, tok.convert_tokens_to_ids("<|end|>")) == ("<|end|>", b"<|end|>")
