"""N-gram (prompt lookup) proposer: no model. Matches the request's last n tokens against its own
earlier context (n from `ngram_max` down to `ngram_min`) and proposes the tokens that followed the
most recent earlier match. Deterministic drafts: q is one-hot."""

from __future__ import annotations

from engine.request import Request
from engine.spec.proposers.base import Draft, ProposeContext


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the longest matching suffix.

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


class NgramProposer:
    propose_is_free = True  # the speculator looks up drafts before deciding whether to verify them
    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def kv_bytes_per_token(self) -> int:
        return 0

    def on_request_finished(self, request: Request) -> None:
        pass

    def step_cost(self, num_requests: int, k: int) -> float:
        return 2e-5 * num_requests

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        return [
            Draft(ngram_lookup(r.all_token_ids, self.n_min, self.n_max, k) if k else [])
            for r, k in zip(requests, num_tokens, strict=True)
        ]
