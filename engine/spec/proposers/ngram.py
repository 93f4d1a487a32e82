"""N-gram (prompt lookup) proposer: no model. Matches the request's last n tokens against its own
earlier context (n from `ngram_max` down to `ngram_min`) and proposes the tokens that followed the
most recent earlier match. Deterministic drafts: q is one-hot."""

from __future__ import annotations

from engine.request import Request
from engine.spec.proposers.base import Draft, ProposeContext, Proposer


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
    (The scan costs O(context) per request and step: 1-1.5 ms a step for 16 requests of ~220
    tokens, 3-5% of a batch-16 step, most of it when nothing matches.)"""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.end = 0  # every n-gram tokens[s:e] with e <= self.end is indexed

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        for e in range(self.end + 1, length):  # n-grams ending before the last token have a follower
            for n, table in self.latest.items():
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e - n
        self.end = max(self.end, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.latest[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


class NgramProposer(Proposer):
    propose_is_free = True  # the speculator looks up drafts before deciding whether to verify them
    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        super().__init__()
        self.n_min, self.n_max = n_min, n_max
        self.states: dict[str, NgramIndex] = {}

    def step_cost(self, num_requests: int, k: int) -> float:
        return 2e-5 * num_requests

    # export_state / import_state: the defaults. The index is rebuilt from the request's tokens
    # at its first lookup on the importing engine (one pass over them).

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        drafts = []
        for r, k in zip(requests, num_tokens, strict=True):
            index = self.states.get(r.request_id)
            if index is None:
                index = self.states[r.request_id] = NgramIndex(self.n_min, self.n_max)
            drafts.append(Draft(index.lookup(r.all_token_ids, k) if k else []))
        return drafts
