"""Penalties, logit_bias and min_tokens (engine/penalties.py): the tokens equal a reference that
applies the definitions to transformers' logits one token at a time; speculation changes nothing
(greedy: the same tokens; sampled: the exact penalized distribution, chi-square with a negative
control that forgets the drafts in each row's counts)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model
from test_speculative import _chi_square_p_value

from engine import LLM, SamplingParams, SpeculativeConfig
from engine.errors import InvalidRequestError

PROMPT = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]  # a repetition n-gram lookup drafts from
PENALIZED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={17: 2.5, 33: -1.0})


def reference_logits(row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                     eos: tuple[int, ...]) -> torch.Tensor:
    """The definitions, token by token: min_tokens, logit_bias, repetition, frequency, presence."""
    out = row.clone()
    if len(output) < params.min_tokens:
        for t in (*(() if params.ignore_eos else eos), *params.stop_token_ids):
            out[t] = float("-inf")
    for t, v in (params.logit_bias or {}).items():
        out[t] += v
    for t in set(prompt) | set(output):
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= params.frequency_penalty * c + params.presence_penalty
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("penalties")
    target = save_tiny_model(str(root / "target"), "llama")
    return {"target": target, "drafter": save_perturbed_copy(target, str(root / "drafter"), noise=0.02)}


def spec(models, method):
    if method is None:
        return None
    return SpeculativeConfig(method=method, model=models["drafter"] if method == "draft" else None,
                             num_speculative_tokens=4, adaptive=False, **({"ngram_min": 1} if method == "ngram" else {}))


def run(models, method, params, prompts=(PROMPT,)):
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec(models, method),
              kv_cache_memory_bytes=1 << 22)
    outs = llm.generate([list(p) for p in prompts], params)
    assert_no_leaked_blocks(llm.engine)
    return outs, llm


def test_greedy_tokens_equal_the_definitions_applied_to_transformers_logits(models):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **PENALIZED)
    (out,), llm = run(models, None, params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    output: list[int] = []
    with torch.no_grad():
        for _ in range(20):
            row = ref(torch.tensor([PROMPT + output])).logits[0, -1]
            output.append(int(reference_logits(row, PROMPT, output, params, llm.engine.eos_token_ids).argmax()))
    assert out.token_ids == output
    (plain,), _ = run(models, None, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert plain.token_ids != output  # the penalties changed something


MILD = dict(frequency_penalty=0.05, repetition_penalty=1.05, logit_bias={17: 0.3})  # n-gram drafts still hit


@pytest.mark.parametrize("method, penalties", [("ngram", PENALIZED), ("ngram", MILD), ("draft", PENALIZED)],
                         ids=["ngram", "ngram-mild", "draft"])
def test_speculation_leaves_penalized_greedy_output_unchanged(models, method, penalties):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, **penalties)
    prompts = [PROMPT, [4, 5, 6, 7] * 6, [11, 12, 13, 11, 12, 13, 11, 12]]
    plain, _ = run(models, None, params, prompts)
    fast, llm = run(models, method, params, prompts)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_draft_tokens > 0
    if penalties is MILD or method == "draft":
        assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_min_tokens_holds_off_the_end_of_sequence(models):
    (free,), llm = run(models, None, SamplingParams(max_tokens=10, temperature=0.0))
    eos = llm.engine.eos_token_ids[0]
    push = {eos: 100.0}  # the model would end at once
    (short,), _ = run(models, None, SamplingParams(max_tokens=10, temperature=0.0, logit_bias=push))
    assert short.token_ids == [eos] and short.finish_reason == "stop"
    for method in (None, "ngram"):
        (held,), _ = run(models, method, SamplingParams(max_tokens=10, temperature=0.0, logit_bias=push, min_tokens=4))
        assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:4]
    stop = free.token_ids[0]
    (cut,), _ = run(models, None, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop], min_tokens=3))
    assert stop not in cut.token_ids[:3]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_drafter_drafts_under_the_same_penalties_as_the_target(models, monkeypatch, tree):
    """A draft model that is the target itself drafts the penalized target's greedy tokens, so
    every chain draft is accepted, and a tree's accepted depth is more than 3x what it is without
    the penalties on the drafter's side (its logits left as they are). Outputs are equal to the
    target alone either way (for trees this checks each node's row counts its own path)."""
    import engine.penalties as pen

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, min_tokens=3, **PENALIZED)
    prompts = [PROMPT, [4, 5, 6, 7] * 6, [11, 12, 13, 11, 12, 13, 11, 12]]
    plain, _ = run(models, None, params, prompts)
    sc = SpeculativeConfig(method="draft", model=models["target"], num_speculative_tokens=4, adaptive=False,
                           **(dict(tree_nodes=8, tree_width=2, tree_depth=4) if tree else {}))
    rates = {}
    for drafts_penalized in (True, False):
        if not drafts_penalized:
            monkeypatch.setattr(pen.Penalties, "apply_to_drafts", lambda *a, **k: None)
        llm = LLM(models["target"], dtype="float32", device="cpu", speculative=sc, kv_cache_memory_bytes=1 << 22)
        outs = llm.generate([list(p) for p in prompts], params)
        assert_no_leaked_blocks(llm.engine)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        stats = llm.engine.spec_stats
        if tree:
            assert stats.num_tree_steps > 10
            rates[drafts_penalized] = stats.num_tree_accepted_tokens / (4 * stats.num_tree_steps)
        else:
            assert stats.num_draft_tokens > 50
            rates[drafts_penalized] = stats.num_accepted_tokens / stats.num_draft_tokens
    if tree:  # (the ranking keeps 8 nodes of the 30 candidates: the top path is not always whole)
        assert rates[True] > 3 * rates[False], rates
    else:
        assert rates[True] == 1.0 and rates[False] < 0.8, rates


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_medusa_heads_draft_after_the_drafts_of_the_heads_before_them(models, tmp_path, monkeypatch, temperature):
    """Medusa drafts every position at once, but under penalties head i's row counts the drafts of
    heads < i as history (as the target's row that verifies it does): each call penalizing draft
    rows sees exactly the request's earlier picks. Greedy output equals the target alone."""
    from helpers import save_tiny_heads

    import engine.penalties as pen

    _, medusa = save_tiny_heads(str(tmp_path / "heads"), models["target"])
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, ignore_eos=True, **PENALIZED)
    calls = []
    real = pen.Penalties.apply_to_drafts

    def spy(self, logits, requests, drafted, token_ids=None):
        calls.append([list(d) for d in drafted])
        return real(self, logits, requests, drafted, token_ids)

    monkeypatch.setattr(pen.Penalties, "apply_to_drafts", spy)
    sc = SpeculativeConfig(method="medusa", model=medusa, num_speculative_tokens=3, adaptive=False)
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=sc, kv_cache_memory_bytes=1 << 22)
    picks = []
    real_propose = llm.engine.speculator.proposer.propose

    def propose(requests, num_tokens, context):
        drafts = real_propose(requests, num_tokens, context)
        picks.append([d.token_ids for d in drafts])
        return drafts

    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", propose)
    outs = llm.generate([PROMPT, [4, 5, 6, 7] * 6], params)
    assert_no_leaked_blocks(llm.engine)
    expected = [[d[:i] for d in drafts if len(d) > i]  # one call per head, heads in order
                for drafts in picks for i in range(max(map(len, drafts)))]
    assert len(picks) > 10 and max(len(d) for drafts in picks for d in drafts) == 3
    assert calls == expected
    if temperature == 0.0:
        plain, _ = run(models, None, params, [PROMPT, [4, 5, 6, 7] * 6])
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("vocab", ["whole", "draft"])
def test_draft_rows_are_penalized_by_the_definitions(vocab):
    """`apply_to_drafts` on a draft row equals the definitions applied with the committed output
    plus the chain's earlier drafts, over the whole vocabulary or a draft vocabulary's columns."""
    from engine.penalties import Penalties
    from engine.request import Request

    torch.manual_seed(0)
    params = SamplingParams(max_tokens=20, min_tokens=6, stop_token_ids=[7], **PENALIZED)
    r = Request("r", [1, 2, 3, 17], params, eos_token_ids=[0])
    r.output_token_ids.extend([33, 17, 33])
    drafted = [5, 33]
    logits = torch.randn(1, 40)
    token_ids = None if vocab == "whole" else torch.tensor([0, 3, 5, 7, 17, 33, 39])
    rows = logits if token_ids is None else logits[:, token_ids]
    got = rows.clone()
    Penalties(40, torch.device("cpu")).apply_to_drafts(got, [r], [drafted], token_ids)
    want = reference_logits(logits[0], r.prompt_token_ids, [*r.output_token_ids, *drafted], params, (0,))
    want = want if token_ids is None else want[token_ids]
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in"),
    (dict(frequency_penalty=True), "frequency_penalty must be a number in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(min_tokens=-1), "min_tokens must be an integer"),
    (dict(min_tokens=20, max_tokens=10), r"min_tokens \(20\) must be <= max_tokens"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_bad_values_are_refused(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**bad)


def test_a_bias_outside_the_vocabulary_is_refused(models):
    llm = LLM(models["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10_000: 1.0}))


# --- the exact penalized distribution ----------------------------------------------------------
VOCAB, NUM_NEW, NUM_SAMPLES = 3, 4, 3000
SAMPLED = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True, presence_penalty=0.8,
                         frequency_penalty=0.9, repetition_penalty=1.5, logit_bias={2: 0.7})
SMALL_PROMPT = [0, 1, 2, 1, 0, 1, 2, 1, 0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB)
    return target, save_tiny_model(str(root / "d"), "llama", vocab_size=VOCAB, seed=5, num_hidden_layers=1)


def exact_penalized(target: str) -> dict[tuple[int, ...], float]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = list(itertools.product(range(VOCAB), repeat=NUM_NEW))
    with torch.no_grad():
        logits = ref(torch.tensor([SMALL_PROMPT + list(s) for s in seqs])).logits[:, len(SMALL_PROMPT) - 1 : -1]
    out = {}
    for s, rows in zip(seqs, logits, strict=True):
        p = 1.0
        for j, row in enumerate(rows):
            probs = torch.softmax(reference_logits(row, SMALL_PROMPT, list(s[:j]), SAMPLED, ()), dim=0)
            p *= probs[s[j]].item()
        out[s] = p
    return out


def counts_of(target, drafter, method) -> tuple[dict, object]:
    """`method`, or draft-tree: trees of up to 6 nodes."""
    torch.manual_seed(1234)
    tree = dict(tree_nodes=6, tree_width=2, tree_depth=3) if method == "draft-tree" else {}
    method = method.removesuffix("-tree")
    sc = SpeculativeConfig(method=method, model=drafter if method == "draft" else None, num_speculative_tokens=3,
                           adaptive=False, **tree)
    llm = LLM(target, dtype="float32", device="cpu", speculative=sc, max_num_seqs=512)
    counts: dict = {}
    for o in llm.generate([SMALL_PROMPT] * NUM_SAMPLES, SAMPLED):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert_no_leaked_blocks(llm.engine)
    return counts, llm.engine.spec_stats


@pytest.mark.parametrize("method", ["draft", "ngram", "draft-tree"])
def test_sampled_penalized_output_follows_the_exact_distribution(small, method):
    """3000 speculative samples of four tokens against the exact penalized target (81 cells, small
    ones pooled): fails at p < 1e-4 (the seed is fixed)."""
    target, drafter = small
    counts, stats = counts_of(target, drafter, method)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, exact_penalized(target), NUM_SAMPLES)
    assert p > 1e-4, f"penalized speculative samples do not follow the target (p={p:.2e})"


def test_rows_that_forget_the_drafts_are_caught(small, monkeypatch):
    """The negative control: counting only the committed output on every row of a chain (not the
    drafts before the row) is biased, and the same test detects it."""
    import engine.penalties as pen

    real = pen.Penalties.apply

    def forgetful(self, sampling, logits):
        saved = [s.spec_token_ids for s in sampling]
        for s in sampling:
            s.spec_token_ids = [0] * len(s.spec_token_ids)  # rows counted as if every draft were token 0
        try:
            real(self, sampling, logits)
        finally:
            for s, ids in zip(sampling, saved, strict=True):
                s.spec_token_ids = ids

    monkeypatch.setattr(pen.Penalties, "apply", forgetful)
    target, drafter = small
    counts, _ = counts_of(target, drafter, "draft")
    assert _chi_square_p_value(counts, exact_penalized(target), NUM_SAMPLES) < 1e-4
