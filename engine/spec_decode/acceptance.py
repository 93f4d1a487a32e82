"""How many drafts the target accepts: per draft position and per request for chains
(`AcceptanceModel`), per verification for trees (`TreeAcceptance`), and per sibling rank inside a
tree (`SiblingAcceptance`). Each keeps decayed counts of the engine's verifications, shrunk toward
a prior; the speculation policy reads them to price drafts.
"""

from __future__ import annotations

import math

from engine.request import Request
from engine.spec_decode.tree import DraftTree

PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before the engine's first verification
PRIOR_TRIALS = 2.0  # weight of that prior (and of position j-1's rate for position j), in trials
REQUEST_PRIOR_TRIALS = 4.0  # weight of the engine-wide rate in a request's own estimate
GLOBAL_DECAY = 1.0 / 256  # engine-wide counts forget with a horizon of ~256 verifications
TREE_PRIOR_ACCEPTED = 3.0  # accepted drafts per tree verification assumed before the first one
# P(a node's j-th drafted child is accepted | its earlier children were not), j >= 2, assumed
# before the first tree verification measures it (weight PRIOR_TRIALS): optimistic enough that
# the first trees are drafted wide and measured, as TREE_PRIOR_ACCEPTED is for their depth.
SIBLING_PRIOR = 0.3
# Decisions read each deeper position's rate (2, 3, ...) as its mean plus this many standard errors.
# Position j is verified only on steps that drafted at least j tokens, which the policy itself
# chooses: read at its posterior mean, one early rejection at position 2 can stop every later step
# from drafting 2, so that the estimate is never corrected and the policy verifies one draft per
# step for the rest of the run.
POSITION_CONFIDENCE_Z = 1.0


class AcceptanceModel:
    """Predicts how many drafts of a request the target will accept.

    Engine-wide, it keeps the conditional acceptance rate of each draft position j (accepted at j
    given that j-1 was accepted), as counts that decay over ~256 verifications; drafters differ
    here (Medusa head j is much weaker than head 1, a draft model less so). Per request, it keeps
    decayed counts of accepted and rejected drafts (decay `acceptance_ema_alpha` per
    verification), shrunk toward the engine-wide rate with REQUEST_PRIOR_TRIALS pseudo-trials.

    P(draft j accepted) = prod_{l <= j} min(1, rho * g_l), where g_l is the engine-wide rate at
    position l and rho = the request's rate / the engine-wide per-token rate (how much easier this
    request's text is than average). The rates decisions read (`accept_probs`) are optimistic for
    positions 2 and deeper: g_l plus POSITION_CONFIDENCE_Z standard errors of its (decayed,
    shrunk) count, but no more than g_{l-1} (its prior: a deeper position is assumed as good as
    the one before until measured otherwise), so that a position drafted too rarely to be known
    gets drafted and measured, while one measured often enough is taken at its mean. Position 1
    is measured by every speculating step and is read at its mean (it alone decides whether a
    step speculates at all). Shrinkage matters: a raw per-request EMA of a few Bernoulli
    trials, used to pick who speculates, overestimates acceptance (the requests picked are those
    whose few trials happened to go well), and a fixed prior for new requests is wrong for text
    the drafter rarely guesses.
    """

    def __init__(self, request_decay: float, max_positions: int = 16) -> None:
        self.request_decay = request_decay
        self.success = [0.0] * max_positions
        self.trials = [0.0] * max_positions
        # (g_1..g_max, their optimistic values, per-token rate), recomputed after each observe
        self._engine_wide: tuple[list[float], list[float], float] | None = None

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        self._engine_wide = None
        keep = 1.0 - GLOBAL_DECAY
        for j in range(min(num_draft, len(self.trials))):  # position j + 1 was reached iff n >= j
            self.success[j] *= keep
            self.trials[j] *= keep
            if num_accepted >= j:
                self.trials[j] += 1.0
                self.success[j] += float(num_accepted > j)
        # per request: n successes and, if n < k, one failure (a truncated geometric observation)
        failures = 1.0 if num_accepted < num_draft else 0.0
        s, t = request.acceptance_counts
        keep = 1.0 - self.request_decay
        request.acceptance_counts = (keep * s + num_accepted, keep * t + num_accepted + failures)

    def _engine(self) -> tuple[list[float], list[float], float]:
        """Every position's rate, its optimistic value and the per-token rate, computed once per
        change (each step asks for them once per decoding request)."""
        if self._engine_wide is None:
            rates, upper, prev = [], [], PRIOR_ACCEPTANCE
            for j, (s, t) in enumerate(zip(self.success, self.trials, strict=True)):
                g = (s + PRIOR_TRIALS * prev) / (t + PRIOR_TRIALS)
                bonus = POSITION_CONFIDENCE_Z * math.sqrt(g * (1.0 - g) / (t + PRIOR_TRIALS))
                upper.append(max(g, min(g + bonus, prev)) if j else g)
                rates.append(g)
                prev = g
            rate = (sum(self.success) + PRIOR_TRIALS * PRIOR_ACCEPTANCE) / (sum(self.trials) + PRIOR_TRIALS)
            self._engine_wide = (rates, upper, rate)
        return self._engine_wide

    def position_rates(self, k: int) -> list[float]:
        """g_1..g_k: each position's rate, shrunk toward the previous position's (or the prior);
        positions beyond those tracked repeat the last one."""
        rates = self._engine()[0]
        return rates[:k] + rates[-1:] * max(0, k - len(rates))

    def optimistic_rates(self, k: int) -> list[float]:
        """`position_rates`, positions 2.. raised by up to POSITION_CONFIDENCE_Z standard errors
        (at most to the previous position's rate)."""
        upper = self._engine()[1]
        return upper[:k] + upper[-1:] * max(0, k - len(upper))

    def engine_rate(self) -> float:
        """Engine-wide per-token acceptance (successes over trials, all positions)."""
        return self._engine()[2]

    def request_rate(self, request: Request) -> float:
        s, t = request.acceptance_counts
        return (s + REQUEST_PRIOR_TRIALS * self.engine_rate()) / (t + REQUEST_PRIOR_TRIALS)

    def accept_probs(self, request: Request, k: int) -> list[float]:
        """P(draft j accepted) for j = 1..k, as decisions read it (`optimistic_rates`)."""
        rho = self.request_rate(request) / max(self.engine_rate(), 1e-6)
        out, p = [], 1.0
        for g in self.optimistic_rates(k):
            p *= min(1.0, rho * g)
            out.append(p)
        return out

    def expected_tokens(self, request: Request, k: int) -> float:
        """Expected tokens from one verification with k drafts (accepted drafts + 1)."""
        return 1.0 + sum(self.accept_probs(request, k))


class TreeAcceptance:
    """Accepted drafts per tree verification, engine-wide, as counts that decay like
    `AcceptanceModel`'s (~256 verifications), shrunk toward a prior of TREE_PRIOR_ACCEPTED with
    PRIOR_TRIALS pseudo-verifications (an optimistic prior: the first trees are tried, then
    measured); and the draft nodes per tree (a value floor, `TreePolicy.tree_floor`, drafts fewer
    than the plan's; a tree the floor left empty counts as a verification of 0 nodes, 0 accepted)."""

    def __init__(self, prior_nodes: float | None = None) -> None:
        self.accepted = 0.0
        self.trials = 0.0
        self.nodes = 0.0
        self.prior_nodes = prior_nodes

    def observe(self, num_accepted: int, num_nodes: int) -> None:
        keep = 1.0 - GLOBAL_DECAY
        self.accepted = keep * self.accepted + num_accepted
        self.trials = keep * self.trials + 1.0
        self.nodes = keep * self.nodes + num_nodes

    def mean(self) -> float:
        return (self.accepted + PRIOR_TRIALS * TREE_PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def mean_nodes(self, planned: float) -> float:
        """Draft nodes per tree, shrunk like `mean` toward the prior given at construction, or
        toward `planned` (the plan's node count) without one; at most `planned`."""
        prior = planned if self.prior_nodes is None else min(self.prior_nodes, planned)
        return min(planned, (self.nodes + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS))


class SiblingAcceptance:
    """How often a tree node's later children save a step, engine-wide: for rank j >= 1 (the
    node's (j+1)-th drafted child: the drafter's (j+1)-th most probable token for a greedy request,
    its (j+1)-th draw for a sampled one), the rate at which it is accepted when the node was
    reached and its children of rank < j were not, as counts that decay like `AcceptanceModel`'s,
    shrunk toward SIBLING_PRIOR with PRIOR_TRIALS pseudo-trials. Measured from every tree
    verification along the accepted path (`observe`), so at every reached node, not only the root.

    Example: a root with children (5, 6, 7) and the target's tokens [7, ...]: rank 1 (6) was tried
    and rejected, rank 2 (7) tried and accepted; then the walk goes on from 7's children."""

    MAX_RANK = 8

    def __init__(self) -> None:
        self.hits = [0.0] * self.MAX_RANK
        self.trials = [0.0] * self.MAX_RANK

    def observe(self, tree: DraftTree, tokens: list[int]) -> None:
        """A verified tree (`DraftTree`) and the tokens the verification produced: the accepted
        path's tokens, then the bonus token (at a leaf) or the correction token (at a node whose
        children were all rejected: it may equal a child's token when sampled, and is no hit)."""
        keep = 1.0 - GLOBAL_DECAY
        self.hits = [keep * h for h in self.hits]
        self.trials = [keep * t for t in self.trials]
        node = 0
        for token in tokens[:-1]:
            kids = tree.children[node]
            match = [c for c in kids if tree.token_ids[c] == token]
            if not match:  # (not a path of this tree)
                return
            rank = kids.index(match[0])
            for j in range(1, min(rank + 1, self.MAX_RANK)):  # ranks 1..rank were tried, the last one hit
                self.trials[j] += 1.0
                self.hits[j] += j == rank
            node = match[0]
        for j in range(1, min(len(tree.children[node]), self.MAX_RANK)):  # every child rejected
            self.trials[j] += 1.0

    def rate(self, rank: int) -> float:
        """P(the child of this rank is accepted | its node reached, the lower ranks not), rank >= 1."""
        return (self.hits[rank] + PRIOR_TRIALS * SIBLING_PRIOR) / (self.trials[rank] + PRIOR_TRIALS)


def top_chain_observation(tree: DraftTree, tokens: list[int]) -> tuple[int, int]:
    """The chain observation a verified tree holds: its path of first children from the root (the
    drafter's top draft at each depth after its top drafts: the chain a chain step would have
    drafted, as deep as the tree follows it) and how many of those drafts the verification's
    tokens accepted, as (drafted, accepted) for `AcceptanceModel.observe`. Without it a policy
    that picks trees stops measuring chains: the chain estimate it compares trees against stays
    wherever it was when trees won (a censoring trap).

    Example: a root with children (5, 6), 5 -> 7: the chain is (5, 7); tokens [5, 7, 2] accept
    both, [5, 3] one, [6, ...] none (the first child rejected)."""
    drafted, node = 0, 0
    while tree.children[node]:
        node = tree.children[node][0]
        drafted += 1
    accepted, node = 0, 0
    for token in tokens[:-1]:
        kids = tree.children[node]
        if not kids or tree.token_ids[kids[0]] != token:
            break
        node = kids[0]
        accepted += 1
    return drafted, accepted
