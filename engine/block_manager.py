"""KV block manager: fixed-size blocks, O(1) free list, reference counts, prefix caching.

Pure Python, no torch. Check-then-act: `allocate_slots` either reserves everything a step needs
or changes nothing and returns False. Full blocks of committed tokens are hashed (chain hash of
the parent block's hash and this block's token ids) and can be shared by later requests with the
same prefix; a hit is verified against the stored token ids, so a hash collision is never served.
Freed blocks keep their cached content until reused (LRU eviction).

The chain hash is the same in every process (`block_hash`: tuples of ints hash alike everywhere;
`hash(None)` would not), so a replica's cached hashes and a router's hashes of a prompt
(`prefix_block_hashes`) can be compared.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROOT_HASH = 0  # the parent of a sequence's first block


def block_hash(parent: int | None, chunk: tuple[int, ...]) -> int:
    """The prefix cache's key for a full block of token ids after the block hashed `parent`."""
    return hash((ROOT_HASH if parent is None else parent, chunk))


def prefix_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chain hashes of a prompt's full blocks that a prefix-cache hit could cover (at least one
    token is always left to compute, as in `KVBlockManager.lookup_prefix`)."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range((len(tokens) - 1) // block_size):
        parent = block_hash(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        # Free blocks in eviction order (front is evicted first). Dict gives O(1) removal on a hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0
        # called with each block handed out fresh (its old content, cached or not, is gone):
        # a feature drafter's record of which blocks hold its KV (feature_buffers.DrafterKVCoverage)
        self.allocation_listeners: list = []

    # --- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding this request's longest cached prefix of full blocks.

        At least one token is always left to compute (the step must produce logits), so a prompt
        of exactly n full blocks can reuse at most n-1 of them.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return []
        self.num_prefix_queries += 1
        hits = self.lookup_prefix(request.all_token_ids)
        if hits:
            self.num_prefix_hits += 1
        return hits

    def lookup_prefix(self, tokens: list[int]) -> list[int]:
        """`find_cached_prefix` for a token list, without counting a query (a router's or a
        disaggregating replica's probe, not an admission)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block = self.cached_blocks.get(h)
            if block is None or self.block_token_ids[block] != chunk:
                break
            hits.append(block)
            parent = h
        return hits

    def cached_hashes(self, limit: int) -> list[int]:
        """Hashes of the blocks the prefix cache holds, the `limit` most recently registered
        (what a replica tells the router it could serve from cache)."""
        if not self.enable_prefix_caching or limit <= 0:
            return []
        keys = list(self.cached_blocks)
        return keys[-limit:]

    # --- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        cached_blocks: list[int] | None = None,
    ) -> bool:
        """Reserve blocks so the request can hold its computed tokens + new + lookahead tokens.

        `cached_blocks` (from `find_cached_prefix`, only at admission) are shared, not copied, and
        advance `num_computed_tokens`. Returns False and changes nothing when blocks run short.
        Example: block_size 16, 30 computed, 2 new, 4 lookahead -> 36 tokens -> 3 blocks.
        """
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(request.block_ids) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if max(num_needed, 0) > self.num_free_blocks - num_revived:
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        if cached_blocks:
            request.block_ids.extend(cached_blocks)
            request.block_hashes.extend(self.block_hash[b] for b in cached_blocks)  # type: ignore[misc]
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
        for _ in range(max(num_needed, 0)):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            for listener in self.allocation_listeners:
                listener(block)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached_blocks.get(h) == block:
                del self.cached_blocks[h]
            self.block_hash[block] = None
            self.block_token_ids[block] = None

    def commit_full_blocks(self, request: Request) -> None:
        """Register the request's newly full blocks of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= len(request.block_hashes):
            return
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block = request.block_ids[i]
            if h not in self.cached_blocks and self.block_hash[block] is None:
                self.cached_blocks[h] = block
                self.block_hash[block] = h
                self.block_token_ids[block] = chunk
            request.block_hashes.append(h)
            parent = h

    def replace_cached(self, h: int, block: int, tokens: tuple[int, ...]) -> None:
        """Point the prefix cache's entry `h` at `block`, which holds the same tokens computed
        again (what a feature drafter needs, `DrafterKVCoverage`); the block it pointed at
        loses its cached content and, if unreferenced, is reused first."""
        old = self.cached_blocks.get(h)
        if old == block or self.block_hash[block] is not None:
            return
        if old is not None:
            self.block_hash[old] = None
            self.block_token_ids[old] = None
            if self.ref_counts[old] == 0:
                self.free_queue.move_to_end(old, last=False)
        self.cached_blocks[h] = block
        self.block_hash[block] = h
        self.block_token_ids[block] = tokens

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks at zero go to the free queue.

        Blocks are released last-first so a prompt's tail is evicted before its head (heads are
        the most shared). Blocks with no cached content go to the front, to be reused first.
        """
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice (request {request.request_id})")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        request.block_ids = []
        request.block_hashes = []

    def check_invariants(self, live_requests: list[Request]) -> None:
        """Reference counts equal the live requests' holdings; free blocks are exactly those at 0."""
        expected = [0] * self.num_blocks
        for r in live_requests:
            for b in r.block_ids:
                expected[b] += 1
        if expected != self.ref_counts:
            bad = [i for i in range(self.num_blocks) if expected[i] != self.ref_counts[i]][:5]
            raise AssertionError(f"ref counts disagree with live requests at blocks {bad}")
        free = {i for i in range(self.num_blocks) if self.ref_counts[i] == 0}
        if free != set(self.free_queue):
            raise AssertionError("free queue does not hold exactly the unreferenced blocks")
        for h, b in self.cached_blocks.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"prefix cache entry {h} points at block {b} with another hash")
