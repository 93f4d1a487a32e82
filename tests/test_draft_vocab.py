"""Frequency-ranked draft vocabulary (FR-Spec): drafting over the N most frequent tokens keeps
greedy output identical and sampled output exactly the target's, costs only the N rows it copies,
and bad settings are refused with a message that says what to do."""

import json
import os
import shutil

import pytest
import torch
from helpers import save_tiny_heads, save_tiny_model
from test_engine import run_staggered
from test_speculative import (
    GREEDY,
    NUM_NEW,
    NUM_SAMPLES,
    SPEC_ARRIVALS,
    SPEC_PROMPTS,
    VOCAB,
    _chi_square_p_value,
    _exact_distribution,
    _sample_counts,
)

from engine import CheckpointError, LLMEngine, SamplingParams, SpeculativeConfig
from engine.request import Request
from engine.spec_decode.proposers.base import sample_drafts
from engine.spec_decode.proposers.draft_vocab import FILENAME, DraftLMHead, resolve_draft_token_ids


def write_ranking(folder: str, ranked: list[int], default_size: int) -> str:
    with open(os.path.join(folder, FILENAME), "w") as f:
        json.dump({"ranked_token_ids": ranked, "default_size": default_size, "source": "test"}, f)
    return folder


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dv")
    target = save_tiny_model(str(root / "target"), "llama")
    eagle, medusa = save_tiny_heads(str(root), target)
    # a "drafter" equal to the target: every draft the reduced vocabulary can express is accepted
    drafter = _copy(target, str(root / "drafter"))
    ranked = list(range(96, -1, -1))  # any permutation of the 97 ids
    for d in (drafter, eagle, medusa):
        write_ranking(d, ranked, default_size=48)
    base = LLMEngine(target, dtype="float32", device="cpu")
    outs = run_staggered(base, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return {
        "target": target,
        "draft": drafter,
        "eagle": eagle,
        "medusa": medusa,
        "baseline": [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))],
    }


def test_resolve_sizes(tiny):
    d = tiny["draft"]
    assert resolve_draft_token_ids(None, d, 97).tolist() == list(range(49, 97))  # default 48, sorted
    assert resolve_draft_token_ids(5, d, 97).tolist() == [92, 93, 94, 95, 96]
    assert resolve_draft_token_ids(0, d, 97) is None
    assert resolve_draft_token_ids(97, d, 97) is None
    assert resolve_draft_token_ids(None, tiny["target"] + "-none", 97) is None  # no file: whole vocab


def test_sample_drafts_maps_ids_and_scatters_probs():
    ids = torch.tensor([2, 5, 7])
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    greedy = [
        Request("a", [1], SamplingParams(temperature=0.0)),
        Request("b", [1], SamplingParams(temperature=0.0)),
    ]
    picked, probs = sample_drafts(logits, greedy, ids, 9)
    assert picked == [5, 2] and probs is None
    sampled = [Request("c", [1], SamplingParams(temperature=1.0, seed=3)), greedy[0]]
    picked, probs = sample_drafts(logits, sampled, ids, 9, [torch.Generator().manual_seed(3), None])
    assert probs.shape == (2, 9) and picked[0] in (2, 5, 7) and picked[1] == 2
    assert torch.allclose(probs[0, ids], torch.softmax(logits[0], -1))
    assert probs[0].sum().item() == pytest.approx(1.0) and probs[0, [0, 1, 3, 4, 6, 8]].abs().sum() == 0


@pytest.mark.parametrize("method", ["draft", "eagle", "medusa"])
@pytest.mark.parametrize("size", [None, 10])
def test_greedy_output_equals_non_speculative(tiny, method, size):
    spec = SpeculativeConfig(
        method=method, model=tiny[method], num_speculative_tokens=4, adaptive=False, draft_vocab_size=size
    )
    engine = LLMEngine(tiny["target"], dtype="float32", device="cpu", speculative=spec)
    head = engine.speculator.proposer.head
    assert head.size == (48 if size is None else size)
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == tiny["baseline"]
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    if method == "draft":
        # the drafter equals the target, so exactly the drafts whose token is in the draft
        # vocabulary can be accepted: fewer accepted with 10 tokens than with 48, none wrong
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_draft_vocab_lowers_acceptance_only_outside_it(tiny):
    """Same drafter as the target: full vocabulary accepts every draft; a draft vocabulary
    accepts less (the target's token is sometimes outside it), never more."""
    accepted = {}
    for size in (0, 48, 10):
        spec = SpeculativeConfig(
            method="draft",
            model=tiny["draft"],
            num_speculative_tokens=4,
            adaptive=False,
            draft_vocab_size=size,
        )
        engine = LLMEngine(tiny["target"], dtype="float32", device="cpu", speculative=spec)
        run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
        s = engine.spec_stats
        accepted[size] = s.num_accepted_tokens / s.num_draft_tokens
    assert accepted[0] == 1.0
    assert accepted[10] < accepted[48] < 1.0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("dv3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB)
    drafter = save_tiny_model(str(root / "d"), "llama", vocab_size=VOCAB, seed=5, num_hidden_layers=1)
    write_ranking(drafter, [2, 0, 1], default_size=2)  # token 1 can never be drafted
    return target, drafter


@pytest.mark.slow  # make test-fast skips it
def test_sampled_distribution_matches_target(small_vocab):
    """Chi-square test (p < 1e-4 fails: false-failure probability 1e-4, fixed seed) of 3000
    samples of (x1..x4) against the target's exact distribution, drafting over 2 of 3 tokens
    (q is zero on token 1, so every emitted 1 comes from the residual or the bonus token)."""
    target, drafter = small_vocab
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)
    spec = SpeculativeConfig(method="draft", model=drafter, num_speculative_tokens=3, adaptive=False)
    counts, stats = _sample_counts(target, spec, params, prompt)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(c for seq, c in counts.items() if 1 in seq) > 100  # token 1 still appears
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p > 1e-4, f"samples with a draft vocabulary do not follow the target distribution (p={p:.2e})"


def test_eagle_draft_vocab_adds_only_its_rows(tiny):
    full = LLMEngine(
        tiny["target"],
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        speculative=SpeculativeConfig(method="eagle", model=tiny["eagle"], draft_vocab_size=0),
    )
    reduced = LLMEngine(
        tiny["target"],
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        speculative=SpeculativeConfig(method="eagle", model=tiny["eagle"], draft_vocab_size=16),
    )
    pf, pr = full.speculator.proposer, reduced.speculator.proposer
    assert pf.head.weight.data_ptr() == full.runner.model.lm_head.weight.data_ptr()
    assert pr.head.weight.shape == (16, full.runner.arch.hidden_size)
    assert pr.num_parameters - pf.num_parameters == 16 * full.runner.arch.hidden_size


def test_bad_settings_are_refused(tiny):
    with pytest.raises(CheckpointError, match="python -m training draft-vocab"):
        LLMEngine(
            tiny["target"],
            dtype="float32",
            device="cpu",
            speculative=SpeculativeConfig(method="draft", model=tiny["target"], draft_vocab_size=8),
        )
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig(method="ngram", draft_vocab_size=8)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig(method="draft", model="x", draft_vocab_size=-1)


def test_ranking_outside_vocab_is_refused(tiny, tmp_path):
    bad = write_ranking(_copy(tiny["draft"], str(tmp_path / "bad")), [500, 1, 2], default_size=2)
    with pytest.raises(CheckpointError, match="outside the target's vocabulary"):
        LLMEngine(
            tiny["target"],
            dtype="float32",
            device="cpu",
            speculative=SpeculativeConfig(method="draft", model=bad),
        )


def test_head_call_shapes():
    w = torch.randn(11, 4)
    head = DraftLMHead(w, torch.tensor([1, 3]))
    h = torch.randn(2, 4)
    assert torch.allclose(head(h), h @ w[[1, 3]].T)
    assert DraftLMHead(w, None)(h).shape == (2, 11) and DraftLMHead(w, None).num_parameters == 0
