"""Token trees under the adaptive policy: how wide and deep each request's tree is (`plan`), what
a step of trees is predicted to make per second (`price`), and whether it beats the best chain
this step (`decide`), with the value floor greedy trees take (`tree_floor`).

It keeps the trees' own measurements (acceptance per tree, sibling rates, drafting round times);
the chain side's estimates and the step cost model are passed in by the speculator.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.acceptance import AcceptanceModel, SiblingAcceptance, TreeAcceptance
from engine.spec_decode.cost_model import StepCalibration, StepCostModel, StepMode, spread_catch_up
from engine.spec_decode.proposers.base import BucketedMedians, Proposer

TREE_PROBE_EVERY = 16  # with adaptive trees, a step drafts trees this often even where chains pay more,
TREE_PROBE_WITHIN = 0.8  # if the trees' predicted tokens/s is at least this fraction of the chain's
# Trees predicted below TREE_PROBE_WITHIN of the chain are not priced again for the same decoding
# requests until the next TREE_PROBE_EVERY step: pricing them is Python work on every step.
# Draft nodes per floored tree assumed before the first one is verified (weight PRIOR_TRIALS):
# optimistic, as TREE_PRIOR_ACCEPTED is (a floor keeps a few confident nodes).
FLOORED_PRIOR_NODES = 5.0
# Floored trees priced far below chains are probed every TREE_PROBE_EVERY steps until
# FLOORED_PROBE_TRIALS of them are measured, then every TREE_FAR_PROBE_EVERY steps (a probe of a
# tree that does not pay costs its step's difference; measured, it need not be paid often).
FLOORED_PROBE_TRIALS = 8
TREE_FAR_PROBE_EVERY = 128


@dataclass(frozen=True)
class TreePrice:
    """A step of trees as `TreePolicy.price` predicts it."""

    rate: float  # tokens per second
    num_requests: int  # decoding requests in the step
    num_verified: float  # tokens the target verifies: every request's root and expected nodes
    ratio: float  # the tree mode's calibration at this batch size
    max_width: int  # the widest plan's width
    floored: bool  # every tree takes the value floor
    debt_s: float  # the drafter's catch-up owed before the trees' first drafts


class TreePolicy:
    """The trees' plans, prices and measurements (module docstring)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.tree_acceptance = TreeAcceptance()  # trees drafted without a value floor
        self.floored_acceptance = TreeAcceptance(FLOORED_PRIOR_NODES)  # greedy trees under one (`floors`)
        self.sibling_acceptance = SiblingAcceptance()
        self.tree_rounds = BucketedMedians()  # seconds of a tree drafting round, by batch size
        # the tree widths the adaptive policy planned (per request, at each trees-or-chains decision)
        self.width_counts: collections.Counter[int] = collections.Counter()
        self.adaptive_floor = 0.0  # the policy's tree_min_prob for the step (`decide`)
        self.far: tuple[int, tuple[str, ...]] | None = None  # (step, decoding ids): trees priced far below chains

    @property
    def floors_trees(self) -> bool:
        """Whether greedy trees take a value floor: a configured `tree_min_prob` > 0, or the
        adaptive policy's (None) on a drafter with probabilities (not n-gram lookup)."""
        p = self.config.tree_min_prob
        if p is None:
            return self.config.adaptive and self.proposer.method != "ngram"
        return p > 0

    def floors(self, request: Request) -> bool:
        """Whether `request`'s trees take the value floor: greedy, where `floors_trees`."""
        return self.floors_trees and request.sampling_params.is_greedy

    def tree_model(self, request: Request) -> TreeAcceptance:
        """The acceptance model of `request`'s trees: floored ones apart (they are smaller)."""
        return self.floored_acceptance if self.floors(request) else self.tree_acceptance

    def tree_floor(self) -> float:
        """The greedy trees' value floor for this step, as a log-probability
        (`ProposeContext.tree_min_logprob`): log of the configured `tree_min_prob`, or of the
        adaptive policy's floor (`decide`); -inf for none."""
        p = self.config.tree_min_prob
        if p is None:
            p = self.adaptive_floor if self.config.adaptive else 0.0
        return math.log(p) if p > 0 else float("-inf")

    def tree_draft_time(self, num_requests: int, depth: int) -> float:
        """Seconds of a tree drafting round: measured per batch size (the median of the rounds
        timed so far), else the proposer's chain estimate for `depth` forwards."""
        measured = self.tree_rounds.median(num_requests)
        return measured if measured is not None else self.proposer.step_cost(num_requests, depth)

    def plan(self, request: Request, max_levels: int, max_nodes: int, cost: StepCostModel | None,
             acceptance: AcceptanceModel) -> tuple[int, int, int]:
        """(nodes, levels, width) of the tree `request` would draft (before the step's token
        budget), within `max_levels` (tree_depth capped like a chain's k) and `max_nodes`
        (tree_nodes capped by the model length).

        Without `adaptive`: those and the configured tree_width. With it, sized per request from
        its own chain acceptance (`AcceptanceModel.accept_probs`: a_1, the chance its drafter's top
        token is accepted, and the chance its top-1 chain reaches each depth, a lower bound for a
        tree's):
        - width: ranks j = 1.. of each expanded node's children are drafted while the chance the
          rank-j child is the one accepted at a reached node, (1 - a_1) * prod_{0<i<j}(1 - s_i) * s_j
          with s_i the engine-wide sibling rates (`SiblingAcceptance`), times the mean chance of
          reaching the tree's levels, beats the cost of verifying one more token (as a fraction
          of a one-token step): a request whose top drafts are nearly always right drafts a
          narrow tree (width 1: a chain), one whose top drafts often miss a wide one;
        - levels: as many as pay for themselves at that width, each costing its width's verified
          tokens and one drafting forward (`level_cost`); at least one (the step already chose
          trees);
        - nodes: at most width per level and max_nodes in all.
        A request whose trees take the value floor (`floors`: greedy, adaptive, no tree_min_prob
        set) plans the configured tree: the floor prunes it to the nodes worth verifying, from
        the drafter's own confidence at this step, which the acceptance models only average."""
        width, depth, nodes = self.config.tree_width, max_levels, max_nodes
        if self.config.adaptive and cost is not None and depth > 1 and not self.floors(request):
            reach = acceptance.accept_probs(request, depth)
            token_cost = self.verify_token_cost(cost)
            level_cost = self.level_cost(cost, width, token_cost)
            levels = max(1, sum(p > level_cost for p in reach))
            mean_reach = sum([1.0, *reach[: levels - 1]]) / levels
            miss = 1.0 - reach[0]  # the top child rejected
            width = 1
            for j in range(1, self.config.tree_width):
                s_j = self.sibling_acceptance.rate(j)
                if mean_reach * miss * s_j <= token_cost:
                    break
                width += 1
                miss *= 1.0 - s_j
            level_cost = self.level_cost(cost, width, token_cost)
            depth = max(1, sum(p > level_cost for p in reach))
            nodes = min(nodes, width * depth)
        return nodes, min(depth, nodes), width

    @staticmethod
    def verify_token_cost(cost: StepCostModel) -> float:
        """One more verified token at batch 1, as a fraction of a one-token target step."""
        base = cost(1, 1)
        return (cost(1, 9) - base) / 8 / base

    def level_cost(self, cost: StepCostModel, width: int, token_cost: float | None = None) -> float:
        """Cost of one more tree level (`width` more verified tokens and one drafting forward),
        as a fraction of a one-token target step (`token_cost`: `verify_token_cost(cost)`)."""
        if token_cost is None:
            token_cost = self.verify_token_cost(cost)
        return width * token_cost + self.proposer.step_cost(1, 1) / cost(1, 1)

    def priced_far(self, step_index: int, request_ids: tuple[str, ...]) -> bool:
        """Whether trees for these decoding requests were priced below TREE_PROBE_WITHIN of the
        best chain within the last TREE_PROBE_EVERY steps, and this is no probe step: they are
        not priced again."""
        far = self.far
        return bool(far is not None and step_index % TREE_PROBE_EVERY and step_index - far[0] < TREE_PROBE_EVERY
                    and far[1] == request_ids)

    def price(self, plans: list[tuple[Request, int, int, int]], num_decoding: int, cost: StepCostModel,
              calibration: StepCalibration, acceptance: AcceptanceModel,
              catch_up_debt: Callable[[list[Request], list[int]], float]) -> TreePrice | None:
        """The predicted tokens/s of a step of trees for `plans` ((request, nodes, levels, width)
        of each decoding request that may draft a tree) among `num_decoding` decoding requests;
        None when no plan is wider than 1 (chains decide).

        Tokens = sum over requests of 1 + E[accepted] (`TreeAcceptance`, scaled by how much easier
        the request's text is than average, at most its depth); time = the target step over every
        request's root and nodes (the cost model times the tree mode's measured calibration) + the
        tree drafting rounds' measured time at this batch size + the drafter's catch-up, spread
        over the steps the requests are expected to go on (`spread_catch_up`). A plan of width 1
        (a tree of one child per node is a chain) is predicted as a chain, from its chain
        acceptance. Floored trees (`floors`) are predicted from their own measured acceptance and
        node count (`floored_acceptance`), their drafting at about as many levels as nodes."""
        self.width_counts.update(w for *_, w in plans)
        plans = [(r, n, d, w) for r, n, d, w in plans if n > 0 and d > 0]
        wide = [(r, n, d) for r, n, d, w in plans if w > 1]
        narrow = [(r, n) for r, n, _, w in plans if w == 1]
        if not wide:
            return None
        b = num_decoding
        engine_rate = max(acceptance.engine_rate(), 1e-6)
        tokens = b + sum(min(d, self.tree_model(r).mean() * acceptance.request_rate(r) / engine_rate)
                         for r, _, d in wide) + sum(sum(acceptance.accept_probs(r, n)) for r, n in narrow)
        # a floor drafts fewer nodes than planned: the measured nodes per tree
        verified = b + sum(self.tree_model(r).mean_nodes(n) for r, n, _ in wide) + sum(n for _, n in narrow)
        tree_ratio = calibration.ratio(b, StepMode.TREE)
        # (a floored tree drafts levels while a node is above the floor: about as many as its nodes)
        levels = max(min(d, max(1, round(self.tree_model(r).mean_nodes(n)))) if self.floors(r) else d
                     for r, n, d in wide)
        time_s = (tree_ratio * cost(b, verified)
                  + self.tree_draft_time(len(wide), levels)
                  + (self.proposer.step_cost(len(narrow), max(n for _, n in narrow)) if narrow else 0.0))
        debt = catch_up_debt([r for r, *_ in wide], [d for *_, d in wide])
        if debt:
            per_step = max(1.0, tokens / b)
            time_s += spread_catch_up(
                debt, statistics.mean((r.sampling_params.max_tokens - r.num_output_tokens) / per_step for r, *_ in wide))
        return TreePrice(rate=tokens / time_s, num_requests=b, num_verified=verified, ratio=tree_ratio,
                         max_width=max(w for *_, w in plans if w > 1),
                         floored=all(self.floors(r) for r, *_ in wide), debt_s=debt)

    def decide(self, price: TreePrice, chain_rate: float, step_index: int, request_ids: tuple[str, ...],
               cost: StepCostModel) -> bool:
        """Trees this step iff their predicted tokens/s (`price`) beat the best chain cap's
        (`chain_rate`, which also covers no drafts), or every TREE_PROBE_EVERY steps while their
        rate is within TREE_PROBE_WITHIN of the chain's (a probe keeps the tree's acceptance and
        costs measured; a hopeless tree, e.g. at a large batch, is not probed; floored ones priced
        far below are, every TREE_PROBE_EVERY steps until FLOORED_PROBE_TRIALS are measured, then
        every TREE_FAR_PROBE_EVERY). Sets the step's floor (`adaptive_floor`) where the policy
        floors greedy trees; where it is >= 1 no node can pay: no trees."""
        b, verified = price.num_requests, price.num_verified
        if self.floors_trees and self.config.tree_min_prob is None:
            # a node is worth drafting iff the tokens it is expected to add (its calibrated path
            # probability) beat what its time would make at the best rate predicted (trees,
            # chains or no drafts): its verified token (the batch's marginal cost here) and its
            # share of a drafting level. At >= 1 no node can pay.
            lo, hi = max(b, verified - 4), verified + 4
            token_s = price.ratio * (cost(b, hi) - cost(b, lo)) / (hi - lo)
            node_s = token_s + self.proposer.step_cost(1, 1) / price.max_width
            self.adaptive_floor = max(0.0, max(price.rate, chain_rate) * node_s)
            if price.floored and self.adaptive_floor >= 1.0:
                self.far = (step_index, request_ids)
                return False
        far = price.rate <= TREE_PROBE_WITHIN * chain_rate
        self.far = (step_index, request_ids) if far else None
        # (floored trees are probed even when priced far below, while some node could pay and no
        # catch-up is owed: the floor keeps them small where verifying costs, so a probe is
        # cheap, and their acceptance cannot be measured otherwise; once measured, rarely)
        if not far:
            probe = step_index % TREE_PROBE_EVERY == 0
        else:
            measured = self.floored_acceptance.trials >= FLOORED_PROBE_TRIALS
            probe = price.floored and not price.debt_s and step_index % (TREE_FAR_PROBE_EVERY if measured else TREE_PROBE_EVERY) == 0
        return price.rate > chain_rate or probe
