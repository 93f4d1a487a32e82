"""Tree width per request: the adaptive policy sizes each request's tree width from its own
acceptance and the measured sibling rates (`Speculator._tree_plan`, `SiblingAcceptance`), and
the drafters grow trees of different widths in one batch (`tree_drafting.grow_trees`), each
exactly as that request's tree alone; greedy output stays the target's."""

import pytest
import torch
from test_tree_engine import GREEDY, MIXED_PROMPTS, PLAIN, models, run_mixed  # noqa: F401 (a fixture)

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from engine.request import Request
from engine.spec_decode.acceptance import SIBLING_PRIOR, SiblingAcceptance, top_chain_observation
from engine.spec_decode.cost_model import StepCostModel
from engine.spec_decode.proposers.tree_drafting import grow_trees, tree_widths
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.tree_policy import TREE_PROBE_EVERY

VOCAB, HIDDEN = 11, 8


class MarkovDrafter:
    """A drafter whose output after a node depends on the node's token only: the head reads the
    token's embedding (hidden = embed[token]) through a fixed random matrix. Enough to pin down
    which tree `grow_trees` must build for any widths."""

    token_ids = None
    vocab_size = VOCAB

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.proj = torch.randn(HIDDEN, VOCAB, generator=g) * 2.0
        self.levels_run: list[list[int]] = []  # per run_level call: the nodes run per request

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.proj

    def grow(self, requests, num_nodes, depths, widths, seeds):
        generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

        def run_level(active, trees: list[DraftTree], counts: list[int]) -> torch.Tensor:
            self.levels_run.append(list(counts))
            return torch.cat([self.embed[list(t.token_ids[-f:])] for t, f in zip(trees, counts, strict=True)])

        root = self.embed[[r.last_token_id for r in requests]]
        return grow_trees(requests, num_nodes, depths, widths, self, root, generators, run_level)[0]


def _request(i: int, sampled: bool) -> Request:
    params = SamplingParams(max_tokens=8, temperature=1.0 if sampled else 0.0)
    return Request(f"r{i}", [1 + i, 2 + i, (3 * i) % VOCAB], params)


@pytest.mark.parametrize("sampled", [False, True])
def test_each_width_is_the_requests_tree_alone(sampled):
    """Requests of widths 1, 2 and 3 drafted in one batch get the trees each gets alone (greedy
    and seeded sampled rows); a node never has more children than its request's width; width 1
    is the drafter's top-1 chain (greedy); a level runs only each request's own width of nodes."""
    widths, depths, nodes = [1, 3, 2, 3], [4, 3, 4, 2], [4, 7, 6, 5]
    seeds = [11, 12, 13, None] if sampled else [None] * 4
    requests = [_request(i, sampled) for i in range(4)]
    drafter = MarkovDrafter()
    together = drafter.grow(requests, nodes, depths, widths, seeds)
    assert drafter.levels_run[0] == [1, 3, 2, 3]  # depth 1's frontier: each request's own width
    for i, r in enumerate(requests):
        tree = together[i].tree
        assert max(len(c) for c in tree.children) <= widths[i]
        assert max(tree.depths) <= depths[i] and tree.num_nodes - 1 <= nodes[i]
        if seeds[i] is not None or not sampled:
            (alone,) = MarkovDrafter().grow([r], [nodes[i]], [depths[i]], [widths[i]], [seeds[i]])
            assert alone.tree.token_ids == tree.token_ids and alone.tree.parents == tree.parents, i
            if sampled:
                torch.testing.assert_close(alone.probs, together[i].probs)  # torch matmuls: batch-dependent low bits
    chain = together[0].tree
    assert chain.parents == tuple(range(-1, chain.num_nodes - 1))
    if not sampled:  # the top-1 token after each node
        token = requests[0].last_token_id
        for t in chain.token_ids[1:]:
            assert t == int(drafter(drafter.embed[token]).argmax())
            token = t


def test_tree_widths_argument_checks():
    assert tree_widths(None, 3, 4) == [4, 4, 4]
    assert tree_widths([1, 6], 2, 4) == [1, 4]
    with pytest.raises(ValueError, match="widths"):
        tree_widths([0, 2], 2, 4)
    with pytest.raises(ValueError, match="widths"):
        tree_widths([2], 2, 4)


def test_sibling_acceptance_follows_the_accepted_path():
    """The class docstring's example, a whole path, a rejection everywhere, and a correction
    token that happens to equal a rejected child's (sampled requests)."""
    tree = DraftTree((0, 5, 6, 7, 8, 9), (-1, 0, 0, 0, 3, 3), (0.0,) * 6)  # root -> 5, 6, 7; 7 -> 8, 9
    s = SiblingAcceptance()
    s.observe(tree, [7, 9, 4])  # rank 2 at the root (rank 1 tried), then rank 1 under 7, then a leaf
    assert [round(t, 6) for t in s.trials[1:3]] == [2.0, 1.0] and [round(h, 6) for h in s.hits[1:3]] == [1.0, 1.0]
    s = SiblingAcceptance()
    s.observe(tree, [3])  # nothing accepted: ranks 1 and 2 were both tried
    assert s.trials[1:3] == [1.0, 1.0] and s.hits[1:3] == [0.0, 0.0]
    assert s.rate(1) < SIBLING_PRIOR and s.rate(3) == SIBLING_PRIOR
    s = SiblingAcceptance()
    s.observe(tree, [6])  # a sampled correction token equal to a rejected child: no hit
    assert s.trials[1:3] == [1.0, 1.0] and s.hits[1:3] == [0.0, 0.0]


@pytest.fixture
def policy(models):  # noqa: F811
    # (the width rule of trees without a value floor: a floored greedy tree plans tree_width)
    engine = LLMEngine(models["target"], dtype="float32", device="cpu",
                       speculative=SpeculativeConfig(model=models["target"], method="draft", adaptive=True,
                                                     tree_nodes=12, tree_width=4, tree_depth=4, tree_min_prob=0.0))
    sp = engine.speculator
    sp.proposer.step_cost = lambda n, k: 1e-5 * k
    return sp


def _costs(slope: float) -> StepCostModel:
    qs = [1, 2, 3, 5, 9]
    return StepCostModel([1, 4], qs, [[1e-3 * (1 + slope * (q - 1)) for q in qs]] * 2)


def _trained(sp, accepted_of_4: int) -> Request:
    r = Request(f"acc{accepted_of_4}", list(range(1, 30)), GREEDY)
    r.block_ids = list(range(8))
    for _ in range(300):
        sp.update_acceptance(r, 4, accepted_of_4)
    return r


def test_width_follows_the_requests_acceptance_and_the_sibling_rates(policy):
    """A verified token costing 0.1 of a step: a request whose top drafts are always accepted
    drafts a chain (width 1, every level), one whose drafts always miss a one-level tree of the
    full width (its siblings at the prior rate 0.3 pay); once siblings are measured never to be
    accepted, that request drafts width 1 too. Where verification is nearly flat (0.005 of a step
    per token, a GPU at batch 1) a request missing 1 in 4 top drafts draws a wider tree than on
    the 0.1 host."""
    sp = policy
    sp.cost = _costs(0.1)
    easy, hard = _trained(sp, 4), _trained(sp, 0)
    assert sp._tree_plan(easy) == (4, 4, 1)
    assert sp._tree_plan(hard) == (4, 1, 4)
    mid = _trained(sp, 3)
    steep_width = sp._tree_plan(mid)[2]
    sp.cost = _costs(0.005)
    flat_width = sp._tree_plan(mid)[2]
    assert flat_width > steep_width
    siblings_never = DraftTree((0, 5, 6, 7, 8), (-1, 0, 0, 0, 0), (0.0,) * 5)
    for _ in range(600):
        sp.trees.sibling_acceptance.observe(siblings_never, [1])  # the top child missed, and every sibling
    sp.cost = _costs(0.1)
    assert sp._tree_plan(hard)[2] == 1


def test_greedy_trees_of_mixed_widths_equal_target(models):  # noqa: F811
    """The draft model drafting trees of widths 1, 2 and 3 in the same steps (forced per request
    through the policy's plan): greedy output equals the target alone, and every drafted tree
    keeps its request's width."""
    prompts = MIXED_PROMPTS
    base = LLMEngine(models["target"], dtype="float32", device="cpu")
    expected, _ = run_mixed(base, prompts, [PLAIN] * len(prompts), [0, 0, 1, 2, 3, 5, 8])
    engine = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(
        model=models["close"], method="draft", adaptive=False, tree_nodes=8, tree_width=3, tree_depth=4))
    seen = force_widths(engine)
    outs, _ = run_mixed(engine, prompts, [GREEDY] * len(prompts), [0, 0, 1, 2, 3, 5, 8])
    assert outs == expected
    assert {w for w, _ in seen} == {1, 2, 3}
    assert all(most <= w for w, most in seen)


def force_widths(engine: LLMEngine) -> list[tuple[int, int]]:
    """Make the speculator plan width 1 + (request number % 3) for each request (nodes capped at
    width x depth); returns the (width, most children of a node) of every tree drafted."""
    sp = engine.speculator
    plan, propose = sp._tree_plan, sp.proposer.propose_trees
    seen: list[tuple[int, int]] = []

    def forced(r):
        nodes, depth, _ = plan(r)
        width = 1 + int(r.request_id.lstrip("r")) % 3
        return min(nodes, width * depth), depth, width

    def spy(requests, num_nodes, max_depths, context, widths=None):
        drafts = propose(requests, num_nodes, max_depths, context, widths)
        seen.extend((w, max(len(c) for c in d.tree.children)) for w, d in zip(widths, drafts, strict=True))
        return drafts

    sp._tree_plan = forced
    sp.proposer.propose_trees = spy
    return seen


def test_top_chain_observation_follows_the_first_children():
    """The docstring's example, and a tree whose first-child path is shorter than its depth."""
    tree = DraftTree((0, 5, 6, 7), (-1, 0, 0, 1), (0.0,) * 4)  # root -> 5, 6; 5 -> 7
    assert top_chain_observation(tree, [5, 7, 2]) == (2, 2)
    assert top_chain_observation(tree, [5, 3]) == (2, 1)
    assert top_chain_observation(tree, [6, 4]) == (2, 0)
    assert top_chain_observation(tree, [9]) == (2, 0)
    deeper_sibling = DraftTree((0, 5, 6, 8), (-1, 0, 0, 2), (0.0,) * 4)  # root -> 5, 6; 6 -> 8
    assert top_chain_observation(deeper_sibling, [6, 8, 1]) == (1, 0)


def test_tree_verifications_keep_measuring_chains(policy):
    """A policy that picks trees must not stop measuring chains (a censoring trap: the chain
    estimate trees are compared against would stay wherever it was when trees won): a request
    whose chain estimate was pessimistic when trees took over, and whose trees then accept their whole top-1 chain every
    step, gets its chain estimate back up from those tree verifications."""
    from types import SimpleNamespace

    sp = policy
    sp.cost = _costs(0.1)
    r = _trained(sp, 0)
    before = sp.acceptance.accept_probs(r, 3)
    tree = DraftTree((0, 5, 6, 7, 8), (-1, 0, 0, 1, 3), (0.0,) * 5)  # top-1 chain 5 -> 7 -> 8, sibling 6
    step = SimpleNamespace(scheduled=[SimpleNamespace(request=r, spec_token_ids=[5, 6, 7, 8], spec_tree=tree)])
    for _ in range(300):
        sp.observe_verifications(step, SimpleNamespace(sampled_token_ids=[[5, 7, 8, 3]]))
    after = sp.acceptance.accept_probs(r, 3)
    assert before[0] < 0.2 and after[0] > 0.8 and after[2] > 0.5, (before, after)


def test_a_step_where_chains_beat_trees_decides_its_chain_once(models):  # noqa: F811
    """The adaptive tree-or-chain policy prices the best chain to compare trees against it; when
    chains win, the step drafts that chain without pricing it again (pricing is Python work that
    a batch-1 step feels), and trees priced far below chains are not priced again before the
    next TREE_PROBE_EVERY step. Same drafts either way: the engine's greedy text is the
    target's, and it still speculates."""
    engine = LLMEngine(models["target"], dtype="float32", device="cpu",
                       speculative=SpeculativeConfig(model=models["target"], method="draft", adaptive=True,
                                                     tree_nodes=12, tree_width=4, tree_depth=4))
    sp = engine.speculator
    sp.trees.tree_draft_time = lambda n, d: 1.0  # trees never pay (nor come within probing distance)
    calls: list[int] = []
    best_chain = sp.best_chain

    def counted(*args, **kwargs):
        calls.append(engine.step_index)
        return best_chain(*args, **kwargs)

    sp.best_chain = counted
    priced: list[int] = []
    trees_pay = sp._trees_pay

    def priced_trees(decoding, step_index):
        priced.append(step_index)
        return trees_pay(decoding, step_index)

    sp._trees_pay = priced_trees
    arrivals = [0] * len(MIXED_PROMPTS)
    outs, _ = run_mixed(engine, MIXED_PROMPTS, [GREEDY] * len(MIXED_PROMPTS), arrivals)
    plain, _ = run_mixed(LLMEngine(models["target"], dtype="float32", device="cpu"), MIXED_PROMPTS,
                         [GREEDY] * len(MIXED_PROMPTS), arrivals)
    assert outs == plain
    assert calls and len(calls) == len(set(calls)), sorted(calls)
    assert sp.num_steps_on > 0 and engine.spec_stats.as_dict()["num_verify_steps"] > 0
    # trees priced far below chains are priced again only every TREE_PROBE_EVERY steps, or when
    # the decoding requests change (a request finished)
    assert priced and len(priced) <= engine.step_index // TREE_PROBE_EVERY + 1 + len(MIXED_PROMPTS), priced
