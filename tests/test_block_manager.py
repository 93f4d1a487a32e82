"""Property tests of the block manager and scheduler (pure Python, milliseconds per example).

Random arrivals, prompt/output lengths, aborts, draft tokens and preemption under a small pool
must never leak or double-free a block, and all blocks are free when all requests end.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import KVBlockManager, prefix_block_hashes
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def fake_runner_output(sched, rng: random.Random, vocab: int = 7) -> list[list[int]]:
    """Pretend to run the model: accept a random prefix of each request's drafts."""
    out = []
    for s in sched.scheduled:
        if not s.needs_sample:
            out.append([])
            continue
        n = rng.randint(0, len(s.spec_token_ids))
        out.append(s.spec_token_ids[:n] + [rng.randrange(vocab)])
    return out


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_requests=st.integers(1, 12),
    lookahead=st.sampled_from([0, 3]),
    prefix_caching=st.booleans(),
)
def test_random_workloads_never_leak_blocks(seed, num_blocks, block_size, num_requests, lookahead, prefix_caching):
    rng = random.Random(seed)
    bm = KVBlockManager(num_blocks, block_size, prefix_caching)
    max_model_len = num_blocks * block_size - lookahead
    if max_model_len < 4:
        return
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 40),
                      max_model_len=max_model_len, num_lookahead_tokens=lookahead)
    shared_prefix = [rng.randrange(7) for _ in range(rng.randint(0, 20))]
    arrivals = sorted(rng.randint(0, 30) for _ in range(num_requests))
    step = 0
    added = 0
    while added < num_requests or sched.has_unfinished_requests():
        while added < num_requests and arrivals[added] <= step:
            n = rng.randint(1, max_model_len - 1)
            prompt = (shared_prefix + [rng.randrange(7) for _ in range(n)])[:n]
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0)
            sched.add_request(Request(f"r{added}", prompt, params, eos_token_ids=(6,)))
            added += 1
        if sched.running and rng.random() < 0.1:
            sched.abort_request(rng.choice(sched.running).request_id)
        if sched.waiting and rng.random() < 0.05:
            sched.abort_request(sched.waiting[-1].request_id)
        # Drafts for decoding requests, as a proposer would make them.
        for r in sched.running:
            if lookahead and r.is_decoding and rng.random() < 0.7:
                k = min(lookahead, max_model_len - r.num_tokens - 1)
                r.spec_token_ids = [rng.randrange(7) for _ in range(max(k, 0))]
        out = sched.schedule()
        for s in out.scheduled:
            r = s.request
            assert r.status == RequestStatus.RUNNING
            need = r.num_computed_tokens + s.num_scheduled_tokens
            assert len(r.block_ids) * block_size >= need, "scheduled tokens without slots"
        results = sched.update_from_output(out, fake_runner_output(out, rng))
        for res in results:
            assert res.request.num_tokens <= max_model_len
        bm.check_invariants(list(sched.requests.values()))
        step += 1
        assert step < 5000, "scheduler made no progress"
    assert bm.num_free_blocks == num_blocks
    assert not sched.running and not sched.waiting


def test_prefix_cache_shares_and_verifies_blocks():
    bm = KVBlockManager(10, 4)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.commit_full_blocks(a)
    b = Request("b", list(range(12)) + [99], SamplingParams(max_tokens=1))
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:3]
    assert bm.allocate_slots(b, 1, cached_blocks=hits)
    assert b.num_computed_tokens == 12 and bm.ref_counts[hits[0]] == 2
    # A hash collision must not be served: corrupt the stored tokens of the first block.
    bm.block_token_ids[hits[0]] = (9, 9, 9, 9)
    c = Request("c", list(range(12)) + [5], SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(c) == []
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 10


def test_reported_hashes_are_a_prompts_block_hashes_in_any_process():
    """What a replica reports (`cached_hashes`) is what a router computes from the prompt's tokens
    (`prefix_block_hashes`), also in another process: the chain hash must not depend on
    per-process state such as hash(None)."""
    import subprocess
    import sys

    bm = KVBlockManager(10, 4)
    tokens = list(range(100, 113))  # 3 full blocks a hit could cover, and one token
    a = Request("a", tokens, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    bm.commit_full_blocks(a)
    hashes = prefix_block_hashes(tokens, 4)
    assert len(hashes) == 3 and bm.cached_hashes(100) == hashes and bm.cached_hashes(2) == hashes[1:]
    assert bm.cached_hashes(0) == [] and KVBlockManager(10, 4, enable_prefix_caching=False).cached_hashes(9) == []
    assert len(bm.lookup_prefix(tokens)) == 3
    code = f"from engine.block_manager import prefix_block_hashes; print(prefix_block_hashes({tokens}, 4))"
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(hashes)


def test_replace_cached_points_the_cache_at_a_recomputed_block():
    """A block recomputed by a later request (for a feature drafter's KV) takes over the cache
    entry: later hits get it; the block it replaces loses its cached content, is reused first
    once free, and the invariants hold throughout."""
    seen = []
    bm = KVBlockManager(10, 4)
    bm.allocation_listeners.append(seen.append)
    a = Request("a", list(range(8)) + [50], SamplingParams(max_tokens=1))
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    b = Request("b", list(range(8)) + [60], SamplingParams(max_tokens=1))
    assert bm.allocate_slots(b, 9)  # recomputed, not reusing a's blocks
    b.num_computed_tokens = 9
    bm.commit_full_blocks(b)
    assert seen == a.block_ids + b.block_ids
    assert bm.find_cached_prefix(Request("x", list(range(8)) + [1], SamplingParams(max_tokens=1))) == a.block_ids[:2]
    for i in range(2):
        bm.replace_cached(b.block_hashes[i], b.block_ids[i], tuple(range(4 * i, 4 * i + 4)))
    bm.check_invariants([a, b])
    c = Request("c", list(range(8)) + [70], SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(c) == b.block_ids[:2]
    a_blocks = list(a.block_ids)
    bm.free(a)  # no cached content left in any of them: first in line for reuse
    assert set(list(bm.free_queue)[:3]) == set(a_blocks)
    bm.free(b)
    bm.check_invariants([])


def test_allocate_is_all_or_nothing():
    bm = KVBlockManager(3, 4)
    r = Request("r", list(range(20)), SamplingParams(max_tokens=1))
    assert not bm.allocate_slots(r, 20)
    assert r.block_ids == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(r, 8, num_lookahead_tokens=4)
    assert len(r.block_ids) == 3
