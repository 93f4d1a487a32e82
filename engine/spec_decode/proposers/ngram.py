"""N-gram (prompt lookup) proposer: no model. Matches the request's last n tokens against its own
earlier context (n from `ngram_max` down to `ngram_min`) and proposes the tokens that followed the
most recent earlier match. Deterministic drafts: q is one-hot.

Trees (`propose_trees`): the continuations after the `tree_width` most recent earlier matches of
the longest matching suffix, merged into a trie (shared prefixes are one path), the most recent
continuation first; its nodes are distinct tokens per parent, deterministic (q one-hot), which
the tree sampler verifies exactly."""

from __future__ import annotations

from engine.request import Request
from engine.spec_decode.proposers.base import Draft, ProposeContext, Proposer
from engine.spec_decode.proposers.tree_drafting import tree_widths
from engine.spec_decode.tree import DraftTree


def ngram_lookup_many(tokens: list[int], n_min: int, n_max: int, k: int, count: int) -> list[list[int]]:
    """Up to `count` continuations (k tokens at most each) following the latest earlier
    occurrences of the longest matching suffix, the most recent first. The definition, as
    `ngram_lookup`; `NgramIndex.lookup_many` is tested to return the same.

    Example: tokens [1,2,3,1,2,4,1,2], n_max 2, count 2 -> [1,2] at 3 and 0 -> [[4,1,2], [3,1,2]][:, :k].
    """
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        found = [tokens[s + n : s + n + k] for s in range(length - n - 1, -1, -1) if tokens[s : s + n] == suffix]
        if found:
            return found[:count]
    return []


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the longest matching suffix.
    The definition; the proposer uses `NgramIndex`, which is tested to return the same.

    Example: tokens [1,2,3,9,1,2], n_max 2 -> suffix [1,2] occurs at 0 -> propose [3,9,1,...][:k].
    """
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # scan right to left for the latest earlier match (excluding the suffix itself)
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramIndex:
    """`ngram_lookup` for a token list that only grows, in O(new tokens + n_max) per call: the
    latest start of every n-gram (n_min <= n <= n_max) that has a follower, in a dict per n.
    (A scan costs O(context) per request and step, most of it when nothing matches.)"""

    def __init__(self, n_min: int, n_max: int, keep: int = 1) -> None:
        self.n_min, self.n_max, self.keep = n_min, n_max, keep
        # per n: n-gram -> its `keep` latest starts, the most recent last
        self.latest: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.end = 0  # every n-gram tokens[s:e] with e <= self.end is indexed

    def lookup_many(self, tokens: list[int], k: int, count: int) -> list[list[int]]:
        """`ngram_lookup_many` (count <= keep)."""
        length = len(tokens)
        for e in range(self.end + 1, length):  # n-grams ending before the last token have a follower
            for n, table in self.latest.items():
                if e >= n:
                    starts = table.setdefault(tuple(tokens[e - n : e]), [])
                    starts.append(e - n)
                    if len(starts) > self.keep:
                        del starts[0]
        self.end = max(self.end, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            starts = self.latest[n].get(tuple(tokens[length - n :]))
            if starts:
                return [tokens[s + n : s + n + k] for s in reversed(starts[-count:])]
        return []

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        found = self.lookup_many(tokens, k, 1)
        return found[0] if found else []


class NgramProposer(Proposer):
    propose_is_free = True  # the speculator looks up drafts before deciding whether to verify them
    method = "ngram"

    supports_tree = True

    def __init__(self, n_min: int, n_max: int, tree_width: int = 1) -> None:
        super().__init__()
        self.n_min, self.n_max = n_min, n_max
        self.tree_width = tree_width  # continuations merged into a tree
        self.states: dict[str, NgramIndex] = {}

    def _index(self, r: Request) -> NgramIndex:
        index = self.states.get(r.request_id)
        if index is None:
            index = self.states[r.request_id] = NgramIndex(self.n_min, self.n_max, self.tree_width)
        return index

    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext, widths: list[int] | None = None) -> list[Draft]:
        """A trie of the request's continuations (module docstring): paths inserted most recent
        first, each up to max_depths[r] tokens, until num_nodes[r] nodes; no match: no drafts.
        widths[r]: the request's tree width, here the continuations it merges (at most tree_width).
        Example: continuations [4, 1, 2] and [3, 1, 2], 4 nodes -> tokens (root, 4, 1, 2, 3),
        parents (-1, 0, 1, 2, 0)."""
        drafts = []
        for r, n, d, w in zip(requests, num_nodes, max_depths, tree_widths(widths, len(requests), self.tree_width),
                              strict=True):
            tokens, parents = [r.last_token_id], [-1]
            child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
            for path in self._index(r).lookup_many(r.all_token_ids, d, w):
                node = 0
                for t in path:
                    if (node, t) not in child:
                        if len(tokens) > n:
                            break
                        child[node, t] = len(tokens)
                        tokens.append(t)
                        parents.append(node)
                    node = child[node, t]
            tree = DraftTree(tuple(tokens), tuple(parents), (0.0,) * len(tokens)) if len(tokens) > 1 else None
            drafts.append(Draft(tokens[1:], None, tree))
        return drafts

    def step_cost(self, num_requests: int, k: int) -> float:
        return 2e-5 * num_requests

    # export_state / import_state: the defaults. The index is rebuilt from the request's tokens
    # at its first lookup on the importing engine (one pass over them).

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        return [Draft(self._index(r).lookup(r.all_token_ids, k) if k else [])
                for r, k in zip(requests, num_tokens, strict=True)]
