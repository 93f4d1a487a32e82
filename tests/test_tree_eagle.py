"""Token trees drafted by EAGLE-1, EAGLE-3 (published layout) and a one-layer native MTP
checkpoint (DeepSeek-V3 layout).

Each tree's draft log-probabilities equal a reference forward without a cache (the target's
features from transformers, the head run along each node's path: training.heads for EAGLE, the
equations of test_eagle3 and test_mtp_native for EAGLE-3 and MTP), across rounds where accepted paths leave the chain positions
(so the target's KV and hidden rows of the accepted nodes must have moved into place); greedy
output equals the target alone in mixed batches and under preemption; sampled output follows the
target's distribution."""

import functools

import pytest
import torch
import transformers
from helpers import save_tiny_heads, save_tiny_model
from test_eagle3 import NUM_LAYERS as EAGLE3_LAYERS
from test_eagle3 import reference_drafts as eagle3_reference_drafts
from test_eagle3 import save_eagle3
from test_mtp_native import add_mtp_layers, reference_drafts
from test_speculative import NUM_SAMPLES, VOCAB, _chi_square_p_value, _exact_distribution
from test_tree_engine import GREEDY as GREEDY_20
from test_tree_engine import (
    MIXED_PARAMS,
    MIXED_PROMPTS,
    PLAIN,
    PROMPT,
    TEMPERATURE_1,
    _sample_counts,
    run_mixed,
)

import engine.model_runner as model_runner
from engine import LLMEngine, SamplingParams, SpeculativeConfig
from training.heads import load_eagle_head

SMALL_VOCAB = 12  # trees cover much of it: paths off the chain positions are accepted often
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TREE = dict(adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)


def _with_vocab(vocab: int, fn):
    import helpers

    old = helpers.TINY["vocab_size"]
    helpers.TINY["vocab_size"] = vocab
    try:
        return fn()
    finally:
        helpers.TINY["vocab_size"] = old


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_eagle")
    target = save_tiny_model(str(root / "target"), "llama", vocab_size=SMALL_VOCAB)
    eagle, _ = _with_vocab(SMALL_VOCAB, lambda: save_tiny_heads(str(root), target, seed=2, scale=2.0))
    mtp = add_mtp_layers(save_tiny_model(str(root / "mtp"), "llama", vocab_size=SMALL_VOCAB), "deepseek", 1,
                         own_head=True, seed=1, scale=1.0)
    # several MTP modules: one per depth, the last applied recursively (MiMo layout, 3 modules)
    mtp3 = add_mtp_layers(save_tiny_model(str(root / "mtp3"), "qwen2", vocab_size=SMALL_VOCAB), "mimo", 3,
                          seed=3, scale=3.0)
    mimo = add_mtp_layers(save_tiny_model(str(root / "mimo"), "qwen2", vocab_size=SMALL_VOCAB), "mimo", 1,
                          seed=4, scale=2.0)
    prompts = [[(3 * i + j * j) % SMALL_VOCAB for j in range(9 + 2 * i)] for i in range(len(MIXED_PROMPTS))]
    # EAGLE-3: its own target (aux layers need depth), a draft vocabulary of 10 of the 12 tokens
    e3_target = save_tiny_model(str(root / "e3_target"), "llama", vocab_size=SMALL_VOCAB, num_hidden_layers=EAGLE3_LAYERS)
    eagle3 = save_eagle3(str(root / "e3"), SMALL_VOCAB, list(range(10)), seed=5, scale=2.0)
    return {"target": target, "eagle": eagle, "mtp": mtp, "mtp3": mtp3, "mimo": mimo, "prompts": prompts,
            "e3_target": e3_target, "eagle3": eagle3}


def spec_for(setup, method: str, **kw) -> tuple[str, SpeculativeConfig]:
    """(the target folder, the tree config) of a method; MTP's layers live in its own target."""
    if method == "eagle":
        return setup["target"], SpeculativeConfig(method="eagle", model=setup["eagle"], **(TREE | kw))
    if method == "eagle3":
        return setup["e3_target"], SpeculativeConfig(method="eagle3", model=setup["eagle3"], **(TREE | kw))
    if method == "mtp3":  # deeper than its 3 modules, so the last one is also applied recursively
        return setup[method], SpeculativeConfig(method="mtp", **(TREE | {"tree_nodes": 10, "tree_depth": 5} | kw))
    return setup[method], SpeculativeConfig(method="mtp", **(TREE | kw))


@pytest.mark.parametrize("method", ["eagle", "mtp", "mimo"])
def test_one_module_kernel_trees_equal_the_python_loop(setup, method, monkeypatch):
    """EAGLE-1 and one-module native MTP (DeepSeek-V3 layout with its own LM head, MiMo layout)
    trees through the one-call kernel (`cpu_kernels.feature_tree`) equal the Python level loop's
    round after round: the same trees (tokens and parents), each sampled node's q to float32
    rounding, the same outputs; greedy and sampled requests (temperature, top-k, top-p) of widths
    3, 2, 3, 1 in one batch."""
    from test_eagle3 import _same_drafts, kernel_and_loop_trees

    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    calls = []
    real = cpu_kernels.feature_tree
    monkeypatch.setattr(cpu_kernels, "feature_tree", lambda *a, **kw: calls.append(a[-2] is not None)
                        or real(*a, **kw))
    target, spec = spec_for(setup, method, tree_nodes=7, tree_width=3, tree_depth=4)
    runs = kernel_and_loop_trees(lambda: LLMEngine(target, dtype="float32", device="cpu", speculative=spec),
                                 "tree_kernel", setup["prompts"])
    assert _same_drafts(*runs) > 5
    assert len(calls) > 5 and any(calls)  # the kernel drafted, sampled requests included
    assert any(len(t) > len(set(t)) for step in runs[0][0] for _, q, t in step.values() if q is not None and t)


@functools.cache
def _eagle_reference(target: str, head: str):
    return (transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(),
            load_eagle_head(head))


def eagle_path_logprobs(setup, tokens: list[int], path: list[int]) -> list[torch.Tensor]:
    """The EAGLE head's log-probabilities after the root and after each prefix of `path`, with no
    cache: element j pairs the target's h_j with token j + 1 (RoPE position j + 1); a drafted
    token's element pairs the head's previous output with it."""
    ref, head = _eagle_reference(setup["target"], setup["eagle"])
    seq, n = list(tokens) + list(path), len(tokens)
    rows = []
    with torch.no_grad():
        feats = ref.model(torch.tensor([tokens])).last_hidden_state[0, : n - 1]
        for _ in range(len(path) + 1):
            m = feats.shape[0]
            out = head(ref.model.embed_tokens(torch.tensor([seq[1 : m + 1]])), feats.unsqueeze(0),
                       torch.arange(1, m + 1).unsqueeze(0))[0, -1]
            rows.append(torch.log_softmax(ref.lm_head(out), -1))
            feats = torch.cat([feats, out.unsqueeze(0)])
    return rows


def eagle3_path_logprobs(setup, tokens: list[int], path: list[int]) -> list[torch.Tensor]:
    ref = {"target": setup["e3_target"], "heads": {"h": setup["eagle3"]}, "boundaries": {"h": (2, 3, 4)}}
    _, q = eagle3_reference_drafts(ref, "h", tokens, len(path) + 1, forced=list(path) + [0], temperature=1.0)
    return list(q.log())


def mtp_path_logprobs(setup, tokens: list[int], path: list[int], target: str = "mtp") -> list[torch.Tensor]:
    """A tree path drafted as a chain of those tokens: module d at depth d, then the last one
    recursively (test_mtp_native's reference)."""
    _, q = reference_drafts(setup[target], tokens, len(path) + 1, forced=list(path) + [0], temperature=1.0)
    return list(q.log())


@pytest.mark.parametrize(("method", "temperature"),
                         [("eagle", None), ("eagle3", None), ("mtp", None), ("mtp3", None), ("eagle3", 0.3), ("mtp3", 0.3)])
def test_tree_drafts_match_reference(setup, method, temperature, monkeypatch):
    """Every drafted tree: each node's cumulative draft log-probability is the reference's along
    its path (at the tree temperature: log-softmax of the reference's log-probabilities / T), and
    each node's children are among its reference top-`tree_width`. Over rounds that accepted
    nodes off the chain positions (their KV and hidden rows moved)."""
    target, spec = spec_for(setup, method, tree_temperature=temperature)
    engine = LLMEngine(target, dtype="float32", device="cpu", speculative=spec)
    # the references load the target per call: once is enough (read-only, eval mode)
    auto = transformers.AutoModelForCausalLM
    monkeypatch.setattr(auto, "from_pretrained", functools.cache(auto.from_pretrained))
    proposer = engine.speculator.proposer
    recorded = []
    propose_trees = proposer.propose_trees

    def spy(requests, num_nodes, max_depths, context, widths=None):
        drafts = propose_trees(requests, num_nodes, max_depths, context, widths)
        recorded.extend(([r.token_at(p) for p in range(r.num_tokens)], d.tree) for r, d in zip(requests, drafts, strict=True))
        return drafts

    monkeypatch.setattr(proposer, "propose_trees", spy)
    moved = []
    real_moves = model_runner.accepted_kv_moves
    monkeypatch.setattr(model_runner, "accepted_kv_moves", lambda *a: moved.append(real_moves(*a)) or moved[-1])
    run_mixed(engine, setup["prompts"][:2], [GREEDY] * 2, [0, 1])
    assert any(src for src, _ in moved), "no accepted path left the chain positions: the test checks no moves"
    reference = {"eagle": eagle_path_logprobs, "eagle3": eagle3_path_logprobs, "mtp": mtp_path_logprobs,
                 "mtp3": functools.partial(mtp_path_logprobs, target="mtp3")}[method]
    checked = 0
    for tokens, tree in recorded:
        for node in range(1, tree.num_nodes):
            path = [tree.token_ids[i] for i in tree.path_to(node)]
            rows = reference(setup, tokens, path)
            if temperature is not None:
                rows = [torch.log_softmax(row / temperature, -1) for row in rows]
            expected = sum(float(rows[j][t]) for j, t in enumerate(path))
            assert tree.cum_logprobs[node] == pytest.approx(expected, abs=1e-4), (tokens, tree, node)
            top = set(rows[-2].topk(spec.tree_width).indices.tolist())
            assert path[-1] in top
            checked += 1
    assert checked >= 40
    if method == "mtp3":  # paths deeper than the modules: the last module applied recursively
        assert max(max(t.depths) for _, t in recorded) > 3


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "mtp3"])
def test_greedy_tree_equals_target_mixed_preempted_cached(setup, method):
    """Trees, chains and non-speculative requests in the same steps with a budget that cuts
    trees; then a small KV cache that preempts; then prefix-cache hits."""
    target, spec = spec_for(setup, method)
    prompts, arrivals = setup["prompts"], [0, 0, 1, 2, 3, 5, 8]
    base = LLMEngine(target, dtype="float32", device="cpu")
    expected, _ = run_mixed(base, prompts, [PLAIN] * len(prompts), arrivals)
    engine = LLMEngine(target, dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=24)
    outs, _ = run_mixed(engine, prompts, MIXED_PARAMS, arrivals)
    assert outs == expected
    assert engine.spec_stats.num_accepted_tokens > 0
    # (EAGLE-3's target has 7 layers, not 2; mtp3 keeps 3 module layers: the same KV bytes hold fewer tokens)
    blocks = {"eagle3": 40, "mtp3": 30}.get(method, 20)
    small = LLMEngine(target, dtype="float32", device="cpu", speculative=spec, block_size=4,
                      kv_cache_memory_bytes=blocks * 4 * 2 * 2 * 2 * 16 * 4 * 2, max_model_len=60)
    assert small.max_model_len == 60  # a smaller pool would cap it and cut the outputs
    outs, _ = run_mixed(small, prompts, [GREEDY_20] * len(prompts), arrivals)
    assert small.scheduler.num_preemptions > 0
    assert outs == expected
    # the same prompts again, all at once: their blocks are prefix-cache hits
    cached = LLMEngine(target, dtype="float32", device="cpu", speculative=spec, block_size=4)
    run_mixed(cached, prompts, [GREEDY_20] * len(prompts), arrivals)
    again, num_cached = run_mixed(cached, prompts, [GREEDY_20] * len(prompts), [0] * len(prompts))
    assert num_cached > 0 and again == expected


def test_tree_temperature_from_the_drafter_folder_or_the_config(setup, tmp_path):
    """A drafter folder's tree_calibration.json sets its greedy trees' temperature (native MTP's:
    the target's folder), the config's overrides it, none means 1.0 (EAGLE-2's ranking); a bad
    file or value is refused by name."""
    import json
    import shutil

    from engine.spec_decode.proposers.tree_drafting import CALIBRATION_FILE

    head = tmp_path / "e3"
    shutil.copytree(setup["eagle3"], head)

    def temperature(**kw):
        spec = SpeculativeConfig(method="eagle3", model=str(head), **(TREE | kw))
        return LLMEngine(setup["e3_target"], dtype="float32", device="cpu", speculative=spec).speculator.proposer.tree_temperature

    assert temperature() == 1.0
    (head / CALIBRATION_FILE).write_text(json.dumps({"greedy_temperature": 0.4}))
    assert temperature() == 0.4
    assert temperature(tree_temperature=0.7) == 0.7
    (head / CALIBRATION_FILE).write_text(json.dumps({"greedy_temperature": -1}))
    with pytest.raises(ValueError, match="tree_calibration.json: greedy_temperature must be a number > 0"):
        temperature()
    for bad in (0, -0.5, float("nan"), float("inf"), True, "0.3"):
        with pytest.raises(ValueError, match="tree_temperature must be a number > 0"):
            SpeculativeConfig(method="eagle3", model=str(head), tree_temperature=bad)
    # native MTP: its layers, and so its calibration, live in the target's folder
    target = tmp_path / "mtp"
    shutil.copytree(setup["mtp"], target)

    def mtp_temperature():
        spec = SpeculativeConfig(method="mtp", **TREE)
        return LLMEngine(str(target), dtype="float32", device="cpu", speculative=spec).speculator.proposer.tree_temperature

    assert mtp_temperature() == 1.0
    (target / CALIBRATION_FILE).write_text(json.dumps({"greedy_temperature": 0.3}))
    assert mtp_temperature() == 0.3


@pytest.mark.parametrize("method", ["eagle3", "mtp3"])
def test_greedy_tree_at_a_low_temperature_equals_target(setup, method):
    """A low tree temperature changes which nodes greedy trees keep (deeper paths: the trees are
    deeper on average than T = 1's), never the output: it equals the target alone in mixed batches."""
    shape = {"tree_nodes": 8, "tree_depth": 6}
    target, spec = spec_for(setup, method, tree_temperature=0.2, **shape)
    prompts, arrivals = setup["prompts"], [0, 0, 1, 2, 3, 5, 8]
    expected, _ = run_mixed(LLMEngine(target, dtype="float32", device="cpu"), prompts, [PLAIN] * len(prompts), arrivals)
    depths = {}
    for t in (None, 0.2):
        engine = LLMEngine(target, dtype="float32", device="cpu", speculative=spec_for(setup, method, tree_temperature=t, **shape)[1])
        proposer = engine.speculator.proposer
        propose_trees, seen = proposer.propose_trees, []

        def spy(*a, _p=propose_trees, _seen=seen, **kw):
            drafts = _p(*a, **kw)
            _seen.extend(max(d.tree.depths) for d in drafts)
            return drafts

        proposer.propose_trees = spy
        outs, _ = run_mixed(engine, prompts, [GREEDY_20] * len(prompts), arrivals)
        assert outs == expected
        depths[t] = sum(seen) / len(seen)
    assert spec.tree_temperature == 0.2 and depths[0.2] > depths[None], depths


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "mtp3"])
def test_greedy_trees_of_mixed_widths_equal_target(setup, method):
    """Trees of widths 1, 2 and 3 in the same steps (forced per request, test_tree_width): greedy
    output equals the target alone and each tree keeps its request's width."""
    from test_tree_width import force_widths

    target, spec = spec_for(setup, method, tree_nodes=8, tree_width=3, tree_depth=3)
    prompts, arrivals = setup["prompts"], [0, 0, 1, 2, 3, 5, 8]
    expected, _ = run_mixed(LLMEngine(target, dtype="float32", device="cpu"), prompts, [PLAIN] * len(prompts), arrivals)
    engine = LLMEngine(target, dtype="float32", device="cpu", speculative=spec)
    seen = force_widths(engine)
    outs, _ = run_mixed(engine, prompts, [GREEDY_20] * len(prompts), arrivals)
    assert outs == expected
    assert {w for w, _ in seen} == {1, 2, 3} and all(most <= w for w, most in seen)


@pytest.fixture(scope="module")
def vocab3(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_eagle_v3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB)
    eagle, _ = _with_vocab(VOCAB, lambda: save_tiny_heads(str(root), target, seed=3, scale=3.0))
    return target, eagle


@pytest.mark.slow  # make test-fast skips it
def test_sampled_eagle_tree_distribution_matches_target(vocab3):
    """Chi-square goodness of fit of 3000 samples of (x1..x4) against the target's exact joint
    distribution; tree children drawn from the head's q without replacement, every other request
    a chain. Fails when p < 1e-4 (false-failure probability 1e-4; fixed seed, reproducible)."""
    target, eagle = vocab3
    counts, llm = _sample_counts(target, eagle, TEMPERATURE_1, method="eagle")
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, PROMPT, TEMPERATURE_1), NUM_SAMPLES)
    assert p > 1e-4, f"EAGLE tree samples do not follow the target distribution (p={p:.2e})"


@pytest.fixture(scope="module")
def vocab3_eagle3(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_eagle3_v3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB, num_hidden_layers=EAGLE3_LAYERS)
    return target, save_eagle3(str(root / "e3"), VOCAB, [0, 2], scale=3.0)  # token 1 is never drafted


@pytest.mark.slow  # make test-fast skips it
def test_sampled_eagle3_kernel_tree_distribution_matches_target(vocab3_eagle3, monkeypatch):
    """The same chi-square test (p < 1e-4 fails: false-failure probability 1e-4, fixed seed) for
    EAGLE-3 trees drafted by the one-call tree kernel (`cpu_kernels.draft_tree` with sampled
    requests: children drawn without replacement over a draft vocabulary of 2 of the 3 tokens,
    every emitted 1 from a residual or a bonus token), every other request a chain."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    sampled_rows = []
    real = cpu_kernels.draft_tree
    monkeypatch.setattr(cpu_kernels, "draft_tree", lambda *a, **kw: sampled_rows.append(
        0 if a[-2] is None else int((a[-2][:, 0] > 0).sum())) or real(*a, **kw))
    target, head = vocab3_eagle3
    counts, llm = _sample_counts(target, head, TEMPERATURE_1, method="eagle3")
    stats = llm.engine.spec_stats
    assert stats.num_tree_steps > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(sampled_rows) > 1000  # sampled trees drafted by the kernel
    assert sum(c for seq, c in counts.items() if 1 in seq) > 100
    p = _chi_square_p_value(counts, _exact_distribution(target, PROMPT, TEMPERATURE_1), NUM_SAMPLES)
    assert p > 1e-4, f"EAGLE-3 kernel tree samples do not follow the target distribution (p={p:.2e})"
