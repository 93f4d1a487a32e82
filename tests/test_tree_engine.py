"""Tree speculation through the engine is lossless: greedy output with draft-model token trees
equals the target alone token for token (fp32), alone or batched with chain and
non-speculative requests, under preemption and with prefix-cache hits; sampled output follows
the target's exact distribution."""

import dataclasses
import math

import pytest
import torch
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model
from test_engine import PROMPTS
from test_speculative import (
    NUM_NEW,
    NUM_SAMPLES,
    _chi_square_p_value,
    _exact_distribution,
    small_vocab,  # noqa: F401 (a fixture)
)

from engine import LLM, LLMEngine, SamplingParams, SpeculativeConfig
from engine.spec_decode.tree import DraftTree, TreeLevel, build_sampled_trees, tree_attention_mask

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
CHAIN = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=3)
PLAIN = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False)
TREE = dict(method="draft", adaptive=False, tree_nodes=8, tree_width=2, tree_depth=4)
MIXED_PROMPTS = PROMPTS[:6] + [[4, 5, 6, 7] * 6]
MIXED_PARAMS = [GREEDY, CHAIN, GREEDY, PLAIN, GREEDY, CHAIN, GREEDY]
ARRIVALS = [0, 0, 1, 2, 3, 5, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_engine")
    target = save_tiny_model(str(root / "target"), "llama")
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    return {"target": target, "close": close}


def run_mixed(engine: LLMEngine, prompts, params, arrivals) -> tuple[dict[str, list[int]], int]:
    """Add prompt i with params[i] at engine step arrivals[i]; step until all finish, checking
    the no-leak invariants at every step. Returns (outputs by id, prompt tokens served from the
    prefix cache)."""
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i])
            outputs[f"r{i}"] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        assert_no_leaked_blocks(engine)
        step += 1
    assert_no_leaked_blocks(engine)
    return outputs, sum(cached.values())


@pytest.fixture(scope="module")
def baseline(models):
    engine = LLMEngine(models["target"], dtype="float32", device="cpu")
    return run_mixed(engine, MIXED_PROMPTS, [PLAIN] * len(MIXED_PROMPTS), ARRIVALS)[0]


def tree_engine(models, drafter: str = "close", **kw) -> LLMEngine:
    return LLMEngine(models["target"], dtype="float32", device="cpu",
                     speculative=SpeculativeConfig(model=models[drafter], **TREE), **kw)


def test_greedy_tree_equals_target_at_batch_1(models, baseline):
    """One request at a time; the target as its own drafter accepts deep paths whose nodes sit
    off the chain positions, so the KV of accepted paths moves."""
    for drafter in ("target", "close"):
        engine = tree_engine(models, drafter)
        for i in (0, 6):
            outs, _ = run_mixed(engine, [MIXED_PROMPTS[i]], [GREEDY], [0])
            assert outs["r0"] == baseline[f"r{i}"], (drafter, i)
        stats = engine.spec_stats
        assert stats.num_verify_steps > 0 and stats.num_accepted_tokens > 0
        if drafter == "target":
            assert stats.mean_accepted_length > 3.0


def test_greedy_tree_mixed_with_chain_and_plain_requests(models, baseline):
    """Trees, chains (a request's own num_speculative_tokens) and non-speculative requests in
    the same steps, with staggered arrivals and a small token budget that cuts trees."""
    engine = tree_engine(models, max_num_batched_tokens=24)
    kinds_per_step = []
    execute = engine.runner.execute

    def spy(sched):
        kinds_per_step.append({"tree" if s.spec_tree is not None else "chain" if s.spec_token_ids else "none"
                               for s in sched.scheduled})
        return execute(sched)

    engine.runner.execute = spy
    outs, _ = run_mixed(engine, MIXED_PROMPTS, MIXED_PARAMS, ARRIVALS)
    assert outs == baseline
    assert any(kinds == {"tree", "chain", "none"} for kinds in kinds_per_step)


def test_greedy_tree_under_preemption(models, baseline):
    bytes_per_token = 2 * 2 * 2 * 16 * 4 * 2  # target + drafter, fp32
    engine = tree_engine(models, block_size=4, kv_cache_memory_bytes=18 * 4 * bytes_per_token, max_model_len=60)
    prompts = [p[:30] for p in MIXED_PROMPTS]
    outs, _ = run_mixed(engine, prompts, [GREEDY] * len(prompts), ARRIVALS)
    assert engine.scheduler.num_preemptions > 0
    ref = LLMEngine(models["target"], dtype="float32", device="cpu")
    assert outs == run_mixed(ref, prompts, [PLAIN] * len(prompts), ARRIVALS)[0]


def test_greedy_tree_with_prefix_cache_hits(models, baseline):
    engine = tree_engine(models, block_size=4)
    first, _ = run_mixed(engine, MIXED_PROMPTS, [GREEDY] * len(MIXED_PROMPTS), ARRIVALS)
    again, num_cached = run_mixed(engine, MIXED_PROMPTS, [GREEDY] * len(MIXED_PROMPTS), [0] * len(MIXED_PROMPTS))
    assert num_cached > 0
    assert first == again == baseline


def test_bf16_tree_equals_target_at_batch_1(models):
    """With the CPU row kernels (exact="rows"), a tree step of at most 16 tokens reads each
    token's context and ancestors in position order, as the one-token steps of its accepted path
    do: even in bfloat16 the output equals the target alone."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("needs the CPU row kernels")
    base = LLMEngine(models["target"], dtype="bfloat16", device="cpu")
    engine = LLMEngine(models["target"], dtype="bfloat16", device="cpu",
                       speculative=SpeculativeConfig(model=models["target"], **TREE))
    assert engine.runner.exact == "rows"
    for prompt in PROMPTS:
        assert run_mixed(engine, [prompt], [GREEDY], [0])[0] == run_mixed(base, [prompt], [PLAIN], [0])[0]
    assert engine.spec_stats.mean_accepted_length > 3.0


def test_bf16_tree_equals_target_without_the_cpu_kernels(models):
    """exact="pad" on the torch backend without the CPU row kernels (a GPU running the torch
    backend, a CPU without the compiled kernels): a tree token's attention is one SDPA call over
    its context and ancestors, laid out as a one-token step's, next to 16-row matmul tiles, so in
    bfloat16 too the output equals the target alone. (The bits themselves are test_tree.py's
    `test_sdpa_row_exact_tree_token_equals_its_one_token_step`; on this tiny model the whole-step
    masked attention, used before, happened to keep these texts too.)"""
    base = LLMEngine(models["target"], dtype="bfloat16", device="cpu", exact="pad")
    engine = LLMEngine(models["target"], dtype="bfloat16", device="cpu", exact="pad",
                       speculative=SpeculativeConfig(model=models["target"], **TREE))
    for e in (base, engine):
        e.runner.row_kernel = False
    for prompt in PROMPTS:
        assert run_mixed(engine, [prompt], [GREEDY], [0])[0] == run_mixed(base, [prompt], [PLAIN], [0])[0]
    assert engine.spec_stats.mean_accepted_length > 3.0 and engine.speculator.num_tree_steps > 0


def test_slot_tables_example():
    from kernels.torch_attn import slot_tables

    tree = tree_attention_mask(DraftTree((1, 2, 3), (-1, 0, 0), (0.0,) * 3))
    table, lens = slot_tables([3], [7], torch.tensor([[3, 5]], dtype=torch.int32), 4, [tree])
    assert lens.tolist() == [5, 6, 6]
    assert table[2].tolist() == [12, 13, 14, 15, 20, 22]
    assert table[1, :6].tolist() == [12, 13, 14, 15, 20, 21]


def test_row_kernel_tree_attention_matches_masked_torch():
    """The row kernel over slot tables computes the tree-masked attention of the torch path."""
    from kernels import cpu_kernels
    from kernels.torch_attn import TorchAttentionBackend, slot_tables

    if not cpu_kernels.available():
        pytest.skip("needs the CPU row kernels")
    torch.manual_seed(0)
    be, bs = TorchAttentionBackend(), 4
    k_cache, v_cache = torch.randn(10, bs, 2, 16), torch.randn(10, bs, 2, 16)
    mask = tree_attention_mask(DraftTree((1, 2, 3, 4, 5), (-1, 0, 0, 1, 2), (0.0,) * 5))
    query_lens, seq_lens, tables = [5, 1, 3], [11, 6, 9], [[3, 1, 7], [2, 5], [0, 4, 6]]
    slots = [t[p // bs] * bs + p % bs for q, s, t in zip(query_lens, seq_lens, tables, strict=True) for p in range(s - q, s)]
    query = torch.randn(sum(query_lens), 4, 16)
    args = (query_lens, seq_lens, tables, slots, bs, "cpu")
    # request 1: a partial tree (4 nodes at positions 2..5, only the last one a query token)
    partial = tree_attention_mask(DraftTree((1, 2, 3, 4), (-1, 0, 0, 1), (0.0,) * 4))
    for masks in ([mask, None, None], [mask, partial, None]):
        ref = be.attention(query, k_cache, v_cache, be.build_metadata(*args, tree_masks=masks), 0.25)
        out = be.attention(query, k_cache, v_cache, be.build_metadata(*args, row_exact="kernel", tree_masks=masks), 0.25)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the partial tree's query (node 3, parent 1) sees positions 0..2 (node 0 at 2), 3 and 5, not 4
    table, lens = slot_tables([1], [6], torch.tensor([[2, 5]], dtype=torch.int32), bs, [partial])
    assert table[0, : int(lens[0])].tolist() == [8, 9, 10, 11, 21]


def test_tree_config_errors(models):
    assert SpeculativeConfig(method="draft", model="m", tree_nodes=8).adaptive  # trees adapt too
    with pytest.raises(ValueError, match="needs method"):
        SpeculativeConfig(method="medusa", model="m", adaptive=False, tree_nodes=8)
    with pytest.raises(ValueError, match=r"tree_nodes must be an integer in \[0, 63\]"):
        SpeculativeConfig(method="draft", model="m", adaptive=False, tree_nodes=64)
    with pytest.raises(ValueError, match="tree_width"):
        SpeculativeConfig(method="draft", model="m", adaptive=False, tree_nodes=8, tree_width=0)
    with pytest.raises(ValueError, match="lower tree_depth"):
        SpeculativeConfig(method="draft", model="m", adaptive=False, tree_nodes=8, tree_width=8, tree_depth=16)
    assert not SpeculativeConfig(method="draft", model="m").uses_tree  # default: chains


def test_tree_floor_config_errors():
    for bad in (1.0, -0.1, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="tree_min_prob"):
            SpeculativeConfig(method="draft", model="m", tree_nodes=8, tree_min_prob=bad)
    assert SpeculativeConfig(method="draft", model="m", tree_nodes=8, tree_min_prob=0.0).tree_min_prob == 0.0


def test_floored_greedy_trees_equal_target_and_shrink(models, baseline):
    """A value floor (`tree_min_prob`) keeps only greedy nodes whose path probability reaches it:
    the output still equals the target alone, fewer nodes are drafted (a tree the floor empties is
    a plain step), and a sampled request's trees take no floor (its draws are kept by position
    only: a floor would bias the rejection sampler)."""
    nodes, floor = {}, 0.0
    for run in range(2):
        engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
            model=models["target"], **(TREE | {"tree_min_prob": floor})))
        proposer, cums = engine.speculator.proposer, []
        propose_trees = proposer.propose_trees

        def record(*args, propose_trees=propose_trees, cums=cums, **kw):
            drafts = propose_trees(*args, **kw)
            cums.extend(c for d in drafts for c in d.tree.cum_logprobs[1:])
            return drafts

        proposer.propose_trees = record
        outs, _ = run_mixed(engine, MIXED_PROMPTS[:3], [GREEDY] * 3, [0, 0, 1])
        assert outs == {f"r{i}": baseline[f"r{i}"] for i in range(3)}
        stats = engine.spec_stats
        nodes[floor] = stats.num_tree_nodes / max(1, stats.num_tree_steps)
        assert stats.num_tree_steps > 0 and cums
        if run:
            assert min(cums) >= math.log(floor) - 1e-6
        else:  # the second run's floor: the median node's path probability (a tiny random model's are low)
            floor = math.exp(sorted(cums)[len(cums) // 2])
    assert nodes[floor] < 0.75 * nodes[0.0], nodes
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
        model=models["close"], **(TREE | {"tree_min_prob": 0.99})))
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    run_mixed(engine, MIXED_PROMPTS[:1], [sampled], [0])
    assert engine.spec_stats.num_tree_nodes >= engine.spec_stats.num_tree_steps * (TREE["tree_nodes"] - 2) > 0


def test_scheduler_cuts_a_tree_to_a_prefix():
    tree = DraftTree((5, 1, 2, 3, 4), (-1, 0, 0, 1, 2), (0.0, -1.0, -2.0, -2.5, -3.0))
    cut = tree.truncated(2)
    assert (cut.token_ids, cut.parents) == ((5, 1, 2), (-1, 0, 0))
    assert tree.truncated(9) is tree


def test_sampled_trees_keep_the_first_draws_chain_first():
    """Deviation order: with 3 nodes out of first-drawn chain a -> c -> e and their siblings, the
    chain is kept (level order would keep a, b, c), whatever the values."""
    level0 = TreeLevel(torch.tensor([[-1, -1]]), torch.tensor([[10, 11]]), torch.tensor([[-3.0, -0.1]]))
    level1 = TreeLevel(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[12, 13, 14, 15]]),
                       torch.tensor([[-6.0, -3.1, -0.2, -0.3]]))
    level2 = TreeLevel(torch.tensor([[0, 0, 2, 2]]), torch.tensor([[16, 17, 18, 19]]),
                       torch.tensor([[-9.0, -6.1, -0.4, -0.5]]))
    tree, = build_sampled_trees([5], [level0, level1, level2], [3])
    assert (tree.token_ids, tree.parents) == ((5, 10, 12, 16), (-1, 0, 1, 2))
    tree, = build_sampled_trees([5], [level0, level1, level2], [5])  # then one deviation, shallow first
    assert (tree.token_ids, tree.parents) == ((5, 10, 11, 12, 13, 16), (-1, 0, 0, 1, 1, 3))


def test_sampled_trees_skip_undrawn():
    """The docstring example of `build_sampled_trees`: no reranking by value, and a child drawn
    after its parent's q ran out (-inf) is no node."""
    level0 = TreeLevel(torch.tensor([[-1, -1]]), torch.tensor([[7, 8]]), torch.tensor([[-0.1, -2.0]]))
    level1 = TreeLevel(torch.tensor([[1, 1]]), torch.tensor([[9, 4]]), torch.tensor([[-2.5, float("-inf")]]))
    tree, = build_sampled_trees([5], [level0, level1], [3])
    assert (tree.token_ids, tree.parents, tree.source_ids) == ((5, 7, 8, 9), (-1, 0, 0, 2), (-1, 0, 1, 2))
    tree, = build_sampled_trees([5], [level0, level1], [1])
    assert tree.token_ids == (5, 7)


def test_seeded_sampled_tree_requests_repeat(models):
    """A seeded request drafts its tree children and verifies with its own generator: the same
    run gives the same tokens."""
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = tree_engine(models)
        outs, _ = run_mixed(engine, MIXED_PROMPTS[:3], [params] * 3, [0, 0, 1])
        assert engine.spec_stats.num_accepted_tokens > 0
        runs.append(outs)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_draft_model_kernel_trees_equal_the_python_loop(models, monkeypatch, tmp_path, draft_vocab):
    """The draft model grows its trees in one kernel call (`cpu_kernels.stack_tree`: its
    RowsStack, packed LM head, the level loop's slots, positions, attention, ranking and draws):
    with the same seeded generators every round's trees (tokens and parents) equal the Python
    level loop's, each sampled node's q equals the loop's to float32 rounding, and the outputs
    are the same; greedy and sampled requests (temperature, top-k, top-p) of widths 3, 2, 3, 1
    in one batch; with the whole vocabulary, and with a draft vocabulary of 48 tokens ranked in
    reverse id order (drafts mapped back to target ids)."""
    import shutil

    from test_draft_vocab import write_ranking
    from test_eagle3 import _same_drafts, kernel_and_loop_trees

    drafter = models["close"]
    if draft_vocab is not None:
        drafter = write_ranking(shutil.copytree(drafter, str(tmp_path / "ranked")), list(range(96, -1, -1)), draft_vocab)

    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    calls = []
    real = cpu_kernels.stack_tree
    monkeypatch.setattr(cpu_kernels, "stack_tree", lambda *a, **kw: calls.append(a[-2] is not None) or real(*a, **kw))
    spec = SpeculativeConfig(model=drafter, draft_vocab_size=draft_vocab,
                             **(TREE | {"tree_nodes": 7, "tree_width": 3, "tree_depth": 4}))
    runs = kernel_and_loop_trees(lambda: LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec),
                                 "tree_kernel", MIXED_PROMPTS)
    assert _same_drafts(*runs) > 5
    assert len(calls) > 5 and any(calls)  # the kernel drafted, sampled requests included
    if draft_vocab is not None:  # only the draft vocabulary's tokens (ids 49..96) were drafted
        assert min(t for step in runs[0][0] for d, _, _ in step.values() for t in d) >= 97 - draft_vocab
    assert any(len(t) > len(set(t)) for step in runs[0][0] for _, q, t in step.values() if q is not None and t)


# --- sampled distribution ---------------------------------------------------------------

PROMPT = [0, 1, 2, 1, 0, 1, 2, 1, 0]
TEMPERATURE_1 = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)


def _sample_counts(target: str, drafter: str, params: SamplingParams, method: str = "draft") -> tuple[dict, LLM]:
    """NUM_SAMPLES continuations of NUM_NEW tokens from a tree-speculating engine: every other
    request drafts a chain instead of a tree, so steps verify both kinds together, each draft
    with the q it was drawn from."""
    torch.manual_seed(1234)
    spec = SpeculativeConfig(method=method, model=drafter, adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)
    llm = LLM(target, dtype="float32", device="cpu", speculative=spec, max_num_seqs=512)
    chain = dataclasses.replace(params, num_speculative_tokens=2)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, [params if i % 2 else chain for i in range(NUM_SAMPLES)])
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert_no_leaked_blocks(llm.engine)
    return counts, llm



@pytest.mark.parametrize("params", [
    TEMPERATURE_1, SamplingParams(max_tokens=NUM_NEW, temperature=0.8, top_k=2, top_p=0.9, ignore_eos=True),
])
@pytest.mark.slow  # make test-fast skips it
def test_sampled_tree_distribution_matches_target(small_vocab, params):  # noqa: F811
    """Chi-square goodness of fit of 3000 samples of (x1..x4) against the target's exact joint
    distribution (81 cells, small cells pooled); tree children are drawn from the drafter's q
    without replacement. It fails when p < 1e-4, so a correct sampler fails with probability
    1e-4 per run and parameter set (the seed is fixed, so the run is reproducible)."""
    target, drafter = small_vocab
    counts, llm = _sample_counts(target, drafter, params)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, PROMPT, params), NUM_SAMPLES)
    assert p > 1e-4, f"tree speculative samples do not follow the target distribution (p={p:.2e})"


def test_broken_tree_sampler_is_detected(small_vocab, monkeypatch):  # noqa: F811
    """The same test catches a tree sampler that always accepts each node's first child."""
    import engine.model_runner as mr

    real = mr.tree_rejection_sample

    def first_child_always(num_nodes, parents, tokens, argmax, target_probs, draft_probs, greedy, gens):
        # a greedy walk where each node's "argmax" is its first child's token (at a leaf: a
        # sample of the target): every first child is accepted
        parent = torch.tensor(parents)
        start = torch.repeat_interleave(torch.cumsum(torch.tensor(num_nodes), 0) - torch.tensor(num_nodes),
                                        torch.tensor(num_nodes))
        fake = torch.multinomial(target_probs, 1).squeeze(1)  # [total]
        child = torch.nonzero(parent >= 0).flatten()  # [C] global ids
        first = torch.full_like(fake, len(parents)).scatter_reduce(0, (parent + start)[child], child, "amin")
        has_child = first < len(parents)
        fake[has_child] = tokens[first[has_child]]
        return real(num_nodes, parents, tokens, fake, None, None, [True] * len(num_nodes), gens)

    monkeypatch.setattr(mr, "tree_rejection_sample", first_child_always)
    target, drafter = small_vocab
    counts, _ = _sample_counts(target, drafter, TEMPERATURE_1)
    p = _chi_square_p_value(counts, _exact_distribution(target, PROMPT, TEMPERATURE_1), NUM_SAMPLES)
    assert p < 1e-4


# --- the adaptive choice between trees and chains -----------------------------------------------


def test_adaptive_trees_equal_target_and_are_chosen_when_cheap(models, baseline):
    """adaptive=True with trees: greedy output still equals the target alone. With a cost model
    where verifying more tokens costs nothing extra (as at small batch on a GPU), the policy drafts
    trees; where each verified token costs a whole step, it drafts chains."""
    from engine.spec_decode.cost_model import StepCostModel

    # chains of at most 2 drafts, trees of depth 4; drafting costs next to nothing (stubbed)
    spec = SpeculativeConfig(model=models["close"], num_speculative_tokens=2, **(TREE | {"adaptive": True}))
    for slope, expect_trees in ((0.0, True), (1.0, False)):
        engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec)
        sp = engine.speculator
        qs = [1, 2, 3, 5, 9]
        sp.cost = StepCostModel([1, 4], qs, [[1e-3 * (1 + slope * (q - 1)) for q in qs]] * 2)
        sp.observe_step_time = lambda sched, seconds: None  # keep the fake model's calibration (1)
        sp.proposer.step_cost = lambda n, k: 1e-6 * k
        sp.trees.tree_draft_time = lambda n, depth: 1e-6 * depth
        outs, _ = run_mixed(engine, MIXED_PROMPTS[:3], [GREEDY] * 3, [0, 0, 1])
        assert outs == {f"r{i}": baseline[f"r{i}"] for i in range(3)}
        if expect_trees:
            assert sp.num_tree_steps > 0 and sp.num_tree_steps >= sp.num_steps_on - 1
        else:
            assert sp.num_steps_on > sp.num_tree_steps  # chains (trees at most on rare probes)
            assert sp.num_tree_steps <= sp.num_steps_on // 8


def test_tree_choice_follows_the_predicted_rate(models):
    """`_trees_pay` compares tokens/s: trees accepting 3 drafts beat chains accepting ~1.6 when
    verification is flat, lose when it is steep; measured tree acceptance moves the choice.
    (Trees without a value floor: tree_min_prob=0.)"""
    from engine.request import Request
    from engine.spec_decode.cost_model import StepCostModel

    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
        model=models["target"], **(TREE | {"adaptive": True, "tree_min_prob": 0.0})))
    sp = engine.speculator
    reqs = []
    for i in range(2):
        r = Request(f"q{i}", list(range(1, 30)), GREEDY)
        r.block_ids = list(range(8 * i, 8 * i + 8))
        reqs.append(r)
    qs = [1, 2, 3, 5, 9]
    sp.proposer.step_cost = lambda n, k: 1e-5 * k
    sp.cost = StepCostModel([1, 4], qs, [[1e-3] * 5] * 2)  # flat
    assert sp._trees_pay(reqs, step_index=1)
    sp.cost = StepCostModel([1, 4], qs, [[1e-3 * q for q in qs]] * 2)  # each token a step
    assert not sp._trees_pay(reqs, step_index=1)
    sp.cost = StepCostModel([1, 4], qs, [[1e-3 * (1 + 0.05 * (q - 1)) for q in qs]] * 2)  # mild slope
    assert sp._trees_pay(reqs, step_index=1)
    for _ in range(2000):  # trees that accept nothing
        sp.trees.tree_acceptance.observe(0, 15)
    assert not sp._trees_pay(reqs, step_index=1)


def test_adaptive_floor_follows_the_verify_cost(models):
    """With `adaptive` and no tree_min_prob, greedy trees take the policy's floor: a node must add
    more expected tokens than its verified token and drafting share make at the best predicted
    rate. Flat verification: a floor near 0; a mild slope: a higher one; each token a whole step:
    no node can pay, so no trees (not even a probe). Floored trees priced far below chains are
    still probed every TREE_PROBE_EVERY steps (unfloored ones are not): their acceptance is only
    measured by drafting them; once FLOORED_PROBE_TRIALS are measured, every TREE_FAR_PROBE_EVERY."""
    from engine.request import Request
    from engine.spec_decode.cost_model import StepCostModel
    from engine.spec_decode.tree_policy import FLOORED_PROBE_TRIALS, TREE_FAR_PROBE_EVERY, TREE_PROBE_EVERY

    qs = [1, 2, 3, 5, 9]
    floors = {}
    for min_prob in (None, 0.0):
        engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
            model=models["target"], **(TREE | {"adaptive": True, "tree_min_prob": min_prob})))
        sp = engine.speculator
        r = Request("q", list(range(1, 30)), GREEDY)
        r.block_ids = list(range(8))
        sp.proposer.step_cost = lambda n, k: 1e-5 * k
        assert sp.trees.floors_trees == (min_prob is None)
        for slope in (0.0, 0.2, 1.0):
            sp.cost = StepCostModel([1, 4], qs, [[1e-3 * (1 + slope * (q - 1)) for q in qs]] * 2)
            pays = sp._trees_pay([r], step_index=TREE_PROBE_EVERY)
            if min_prob is None:
                floors[slope] = (pays, sp.trees.adaptive_floor, math.exp(sp.trees.tree_floor()))
        if min_prob is None:
            assert floors[0.0][0] and floors[0.0][1] < 0.1 and floors[0.0][2] == pytest.approx(floors[0.0][1])
            assert floors[0.0][1] < floors[0.2][1] < 1.0
            assert not floors[1.0][0] and floors[1.0][1] >= 1.0
        else:
            assert sp.trees.tree_floor() == float("-inf")
        # trees that accept nothing: priced far below chains; probed only when floored
        sp.cost = StepCostModel([1, 4], qs, [[1e-3 * (1 + 0.2 * (q - 1)) for q in qs]] * 2)
        for _ in range(FLOORED_PROBE_TRIALS - 1):
            sp.trees.tree_model(r).observe(0, 4)
        assert not sp._trees_pay([r], step_index=1)
        assert sp._trees_pay([r], step_index=TREE_PROBE_EVERY) == (min_prob is None)
        # measured: probed only every TREE_FAR_PROBE_EVERY steps
        for _ in range(2000):
            sp.trees.tree_model(r).observe(0, 4)
        assert not sp._trees_pay([r], step_index=TREE_PROBE_EVERY)
        assert sp._trees_pay([r], step_index=TREE_FAR_PROBE_EVERY) == (min_prob is None)


def test_adaptive_trees_are_sized_per_request(models):
    """With `adaptive`, a request whose drafts are all accepted gets every level (tree_depth) at
    width 1 (its drafter's top token is always right: siblings would be wasted; a chain), one
    whose drafts are all rejected a one-level tree of tree_width nodes (at the prior sibling
    rate, siblings pay); without `adaptive` both get the configured tree. (test_tree_width
    covers the width rule.) Trees without a value floor (tree_min_prob=0); with one, a greedy
    request plans the configured tree and the floor prunes it (test_adaptive_floor_*)."""
    from engine.request import Request
    from engine.spec_decode.cost_model import StepCostModel

    qs = [1, 2, 3, 5, 9]
    plans = {}
    for adaptive in (True, False):
        engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
            model=models["target"], **(TREE | {"adaptive": adaptive, "tree_min_prob": 0.0})))
        sp = engine.speculator
        sp.proposer.step_cost = lambda n, k: 1e-5 * k
        sp.cost = StepCostModel([1, 4], qs, [[1e-3 * (1 + 0.1 * (q - 1)) for q in qs]] * 2)  # a level: ~0.2
        easy, hard = Request("easy", list(range(1, 30)), GREEDY), Request("hard", list(range(1, 30)), GREEDY)
        for i, r in enumerate((easy, hard)):
            r.block_ids = list(range(8 * i, 8 * i + 8))
        for _ in range(300):  # drafts of 4: `easy` accepts all, `hard` none
            sp.update_acceptance(easy, 4, 4)
            sp.update_acceptance(hard, 4, 0)
        plans[adaptive] = (sp._tree_plan(easy), sp._tree_plan(hard))
    cfg = TREE
    assert plans[False] == ((cfg["tree_nodes"], cfg["tree_depth"], cfg["tree_width"]),) * 2
    assert plans[True][0] == (cfg["tree_depth"], cfg["tree_depth"], 1)
    assert plans[True][1] == (cfg["tree_width"], 1, cfg["tree_width"])


# --- n-gram trees -------------------------------------------------------------------------------


def test_ngram_tree_is_a_trie_of_the_latest_continuations():
    """The propose_trees docstring example: the continuations of the suffix [1, 2] after its two
    earlier matches, the most recent first, cut at 4 nodes; then two that share a first token."""
    from engine.request import Request
    from engine.spec_decode.proposers.base import ProposeContext
    from engine.spec_decode.proposers.ngram import NgramProposer

    r = Request("n", [1, 2, 3, 1, 2, 4, 1, 2], GREEDY)
    draft, = NgramProposer(1, 2, tree_width=2).propose_trees([r], [4], [3], ProposeContext({}))
    assert (draft.tree.token_ids, draft.tree.parents) == ((2, 4, 1, 2, 3), (-1, 0, 1, 2, 0))
    assert draft.token_ids == [4, 1, 2, 3] and draft.probs is None
    shared, = NgramProposer(1, 2, tree_width=2).propose_trees([Request("m", [5, 1, 2, 3, 5, 1, 2, 3, 7, 1, 2], GREEDY)],
                                                              [6], [2], ProposeContext({}))
    assert (shared.tree.token_ids, shared.tree.parents) == ((2, 3, 7, 5), (-1, 0, 1, 1))  # [3, 7], [3, 5]


def test_ngram_trees_equal_target_and_keep_the_distribution(models, baseline, small_vocab):  # noqa: F811
    """Greedy: n-gram trees mixed with chains and plain requests equal the target alone. Sampled:
    deterministic distinct children (q one-hot) through the tree sampler keep the target's
    distribution (chi-square as above; false-failure probability 1e-4)."""
    spec = SpeculativeConfig(method="ngram", adaptive=False, tree_nodes=6, tree_width=3, tree_depth=3)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=24)
    outs, _ = run_mixed(engine, MIXED_PROMPTS, MIXED_PARAMS, ARRIVALS)
    assert outs == baseline and engine.spec_stats.num_tree_steps > 0
    target, _ = small_vocab
    torch.manual_seed(1234)
    llm = LLM(target, dtype="float32", device="cpu", speculative=spec, max_num_seqs=512)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, [TEMPERATURE_1] * NUM_SAMPLES)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    stats = llm.engine.spec_stats
    assert stats.num_tree_steps > 500 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, PROMPT, TEMPERATURE_1), NUM_SAMPLES)
    assert p > 1e-4, f"n-gram tree samples do not follow the target distribution (p={p:.2e})"
