"""Prefill/decode handoff (engine/handoff.py): a request prefilled on engine A, exported after its
first token (and the first drafting round), pickled as Ray would, and imported into engine B gives
the same tokens as one engine, token for token (fp32, CPU), for no speculation and every drafter,
greedy and seeded sampling; B's first verifications accept what the single engine's did."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_heads, save_tiny_model

from engine import (
    EngineOverloadedError,
    Handoff,
    HandoffMismatchError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    SpeculativeConfig,
)
from engine.spec_decode.proposers.draft_model import DraftModelState

METHODS = [None, "draft", "eagle", "medusa", "ngram"]
# 38 tokens (2 full blocks of 16 + 6) with repetition, so n-gram lookup finds matches.
PROMPT = list(range(36, 42)) + [11, 12, 13, 11, 12, 13, 11, 12] + [4, 5, 6, 7] * 6
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("handoff")
    target = save_tiny_model(str(root / "target"), "llama")
    close = save_perturbed_copy(target, str(root / "close"), noise=0.02)
    eagle, medusa = save_tiny_heads(str(root), target)
    return {"target": target, "draft": close, "eagle": eagle, "medusa": medusa, "ngram": None}


def make_engine(models, method: str | None, target: str = "target", **kwargs) -> LLMEngine:
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, model=models[method], num_speculative_tokens=4, adaptive=False)
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    return LLMEngine(models[target], speculative=spec, **kwargs)


def listen(engine: LLMEngine, request_ids: set[str]) -> list[tuple[int, int]]:
    """(drafted, accepted) of each verification step of the given requests, in order."""
    log: list[tuple[int, int]] = []
    engine.step_listeners.append(lambda rec: log.extend(v for rid, v in rec.accepted.items() if rid in request_ids))
    return log


def run_to_end(engine: LLMEngine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert_no_leaked_blocks(engine)


def colocated(models, method, params, prompt=PROMPT) -> tuple[list[int], list[tuple[int, int]]]:
    engine = make_engine(models, method)
    log = listen(engine, {"c"})
    engine.add_request("c", prompt, params)
    outs: dict[str, list[int]] = {}
    run_to_end(engine, outs)
    return outs["c"], log


def prefill(engine: LLMEngine, params, prompt=PROMPT, rid: str = "p", **kwargs) -> tuple[Handoff, list[int]]:
    """Run `rid` on the prefill engine until it is exported; the handoff after a pickle round trip."""
    engine.add_request(rid, prompt, params, export_after_prefill=True, **kwargs)
    outs: dict[str, list[int]] = {}
    handoffs: dict[str, Handoff] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.finish_reason is None  # the handoff is not a finish of the step's output
        handoffs.update(engine.take_handoffs())
        assert_no_leaked_blocks(engine)
    assert set(handoffs) == {rid}
    h = pickle.loads(pickle.dumps(handoffs[rid]))
    assert list(h.output_token_ids) == outs[rid] and len(outs[rid]) == 1
    assert engine.handoff_stats.num_exported >= 1
    return h, outs[rid]


def decode(engine: LLMEngine, h: Handoff, rid: str = "d", **kwargs) -> tuple[list[int], list[tuple[int, int]]]:
    """Import into the decode engine and run to the end: all output tokens, (drafted, accepted) log."""
    log = listen(engine, {rid})
    engine.import_handoff(rid, h, **kwargs)
    assert_no_leaked_blocks(engine)
    outs: dict[str, list[int]] = {rid: list(h.output_token_ids)}
    run_to_end(engine, outs)
    engine.step_listeners.pop()
    return outs[rid], log


def assert_handoff_equals_colocated(models, method: str, params) -> Handoff:
    """Prefill on one engine, hand the request over (pickled), decode on another: the tokens and
    each verification's (drafted, accepted) equal one engine's. Returns the handoff."""
    expected, expected_log = colocated(models, method, params)
    h, _ = prefill(make_engine(models, method), params)
    tokens, log = decode(make_engine(models, method), h)
    assert tokens == expected and log == expected_log
    return h


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_handoff_equals_colocated(models, method, params):
    """Tokens equal one engine's, and B's verifications accept exactly what the single engine's
    did step by step (the drafter state, drafts, draft distributions and generator travel)."""
    expected, expected_log = colocated(models, method, params)
    a, b = make_engine(models, method), make_engine(models, method)
    h, _ = prefill(a, params)
    assert h.num_computed_tokens == len(PROMPT) and h.num_kv_blocks == 3
    if method is None:
        assert not h.spec_token_ids and h.drafter_kv is None and h.proposer_state is None
    else:
        # the prefill side drafts the first round (n-gram: if the sampled first token has a match)
        assert h.spec_token_ids or (method == "ngram" and not params.is_greedy)
        assert (h.drafter_kv is not None) == (method in ("draft", "eagle"))
        assert (h.proposer_state is None) == (method == "ngram")
    assert (h.generator_state is not None) == (params.seed is not None)
    assert (h.draft_probs is not None) == (method in ("draft", "eagle", "medusa") and not params.is_greedy)
    tokens, log = decode(b, h)
    assert tokens == expected
    assert log == expected_log
    if h.spec_token_ids:
        assert log and log[0][0] == len(h.spec_token_ids)  # B's first step verified A's drafts
    assert b.handoff_stats.num_imported == 1 and b.handoff_stats.num_blocks_copied == 3
    for engine in (a, b):
        assert not engine.has_unfinished_requests()
        assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_token_tree_drafts_travel(models, method, params):
    """On tree engines the prefill side's first drafts are a token tree: the handoff carries it
    (and, sampled, each node's q), the decode side's first step verifies that tree, and tokens
    and every verification's (drafted, accepted) equal one engine's. A chain engine importing it
    verifies the tree cut to its lookahead (its first 2 nodes), still exactly."""
    tree = dict(method=method, model=models[method], adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)

    def engine(**kw):
        return LLMEngine(models["target"], dtype="float32", device="cpu", speculative=SpeculativeConfig(**(tree | kw)))

    one = engine()
    expected_log = listen(one, {"c"})
    one.add_request("c", PROMPT, params)
    outs: dict[str, list[int]] = {}
    run_to_end(one, outs)
    h, _ = prefill(engine(), params)
    assert h.spec_tree is not None and h.spec_tree.token_ids[1:] == h.spec_token_ids
    assert h.spec_tree.num_nodes - 1 == 6 and max(h.spec_tree.depths) > 1  # a tree, not a chain
    assert (h.draft_probs is not None) == (not params.is_greedy)
    b = engine()
    verified = []
    execute = b.runner.execute
    b.runner.execute = lambda sched: verified.extend(s.spec_tree for s in sched.scheduled) or execute(sched)
    tokens, log = decode(b, h)
    assert tokens == outs["c"] and log == expected_log
    assert verified[0] == h.spec_tree
    chain = LLMEngine(models["target"], dtype="float32", device="cpu",
                      speculative=SpeculativeConfig(method=method, model=models[method], num_speculative_tokens=2,
                                                    adaptive=False))
    verified.clear()
    execute_chain = chain.runner.execute
    chain.runner.execute = lambda sched: verified.extend(s.spec_tree for s in sched.scheduled) or execute_chain(sched)
    tokens, _ = decode(chain, h, rid="d2")
    if params.is_greedy:
        assert tokens == outs["c"]
    assert verified[0] == h.spec_tree.truncated(2)
    for e in (b, chain):
        assert not e.has_unfinished_requests()
        assert_no_leaked_blocks(e)


def test_handoff_with_a_wrong_tree_is_refused(models):
    """A tree whose nodes are not the handoff's drafts, or whose root is not its last token."""
    spec = SpeculativeConfig(method="draft", model=models["draft"], adaptive=False, tree_nodes=6, tree_width=2,
                             tree_depth=3)
    h, _ = prefill(LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec), GREEDY)
    t = h.spec_tree
    b = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec)
    v = b.vocab_size
    wrong_node = dataclasses.replace(t, token_ids=(t.token_ids[0], (t.token_ids[1] + 1) % v, *t.token_ids[2:]))
    wrong_root = dataclasses.replace(t, token_ids=((t.token_ids[0] + 1) % v, *t.token_ids[1:]))
    for bad in (wrong_node, wrong_root, "tree"):
        with pytest.raises(InvalidRequestError, match="spec_tree"):
            b.import_handoff("x", dataclasses.replace(h, spec_tree=bad))
        assert_no_leaked_blocks(b)
    assert not b.has_unfinished_requests()


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_chunked_prefill_and_no_speculation_request(models, method):
    """A prefilled in chunks of 16 tokens gives a handoff B continues to one engine's tokens; a
    request with speculative=False carries no drafter state or KV."""
    expected, _ = colocated(models, method, GREEDY)
    h, _ = prefill(make_engine(models, method, max_num_batched_tokens=16), GREEDY)
    assert h.spec_token_ids
    assert decode(make_engine(models, method), h)[0] == expected
    off = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    h, _ = prefill(make_engine(models, method), off)
    assert not h.spec_token_ids and h.drafter_kv is None and h.proposer_state is None
    assert decode(make_engine(models, method), h)[0] == expected


def test_handoff_size(models):
    """num_bytes counts every tensor: target KV of 3 blocks, drafter KV, draft probs, generator."""
    a = make_engine(models, "draft")
    h, _ = prefill(a, SAMPLED)
    kv = 2 * 2 * 3 * 16 * 2 * 16 * 4  # layers x (k, v) x blocks x block_size x kv heads x head_dim x fp32
    assert h.kv.numel() * 4 == kv
    assert h.num_bytes == kv + h.drafter_kv.numel() * 4 + h.draft_probs.numel() * 4 + h.generator_state.numel()
    assert a.stats()["handoff"]["num_bytes_exported"] == h.num_bytes


def _draft_forward_tokens(engine: LLMEngine) -> list[int]:
    """Count the tokens each draft-model forward runs over (its catch-up is the drafter's work)."""
    proposer = engine.speculator.proposer
    real, counts = proposer._forward, []

    def forward(chunks):
        counts.append(sum(len(c.token_ids) for c in chunks))
        return real(chunks)

    proposer._forward = forward
    return counts


@pytest.mark.parametrize("method", ["draft", "eagle", "medusa", "ngram"])
def test_without_drafter_state(models, method):
    """Ablation: the importer drops the drafter's state and KV. Outputs still equal one engine's;
    the draft model catches up over the whole context (its first round here runs over the prompt),
    EAGLE drafts without the prompt's rows (other drafts), Medusa and n-gram need no state at all."""
    expected, expected_log = colocated(models, method, GREEDY)
    h, _ = prefill(make_engine(models, method), GREEDY)
    b = make_engine(models, method)
    counts = _draft_forward_tokens(b) if method == "draft" else None
    tokens, log = decode(b, h, with_drafter_state=False)
    assert tokens == expected
    assert_no_leaked_blocks(b)
    if method == "draft":
        assert counts[0] >= len(PROMPT)  # caught up from position 0
        with_state = make_engine(models, method)
        counts_with = _draft_forward_tokens(with_state)
        decode(with_state, h)
        assert counts_with[0] <= 4 + 1  # accepted drafts + bonus token
        assert sum(counts) - sum(counts_with) >= len(PROMPT)
    elif method == "eagle":
        drafts_with, drafts_without = [], []
        for engine, drafts, flag in ((make_engine(models, method), drafts_with, True),
                                     (make_engine(models, method), drafts_without, False)):
            engine.import_handoff("d", h, with_drafter_state=flag)
            while engine.has_unfinished_requests():
                engine.step()
                r = engine.scheduler.requests.get("d")
                drafts.append(list(r.spec_token_ids) if r else [])
        assert drafts_with != drafts_without
    else:
        assert log == expected_log


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_export_without_drafter_state_is_smaller_and_exact(models, method):
    """The ablation on the exporting side: no drafter KV or state travels (fewer bytes, exactly
    the drafter's share), and the importer still produces the co-located tokens."""
    expected, _ = colocated(models, method, GREEDY)
    full, _ = prefill(make_engine(models, method), GREEDY)
    lean, _ = prefill(make_engine(models, method), GREEDY, export_drafter_state=False)
    assert lean.drafter_kv is None and lean.proposer_state is None
    assert full.drafter_kv is not None
    drafter_bytes = full.drafter_kv.numel() * full.drafter_kv.element_size()
    if method == "eagle":
        drafter_bytes += full.proposer_state.rows.numel() * full.proposer_state.rows.element_size()
    assert lean.num_bytes == full.num_bytes - drafter_bytes
    b = make_engine(models, method)
    tokens, _ = decode(b, lean)
    assert tokens == expected
    assert_no_leaked_blocks(b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_kv_exported_on_the_gpu_stays_there_and_imports_exactly(models, method):
    """`export_kv_on_device` (set when the transport is NIXL, which moves GPU memory itself): the
    handoff's target and drafter KV are CUDA tensors, and the importer continues exactly."""
    # three engines in one process: each its own KV size (sized automatically, the first would
    # take gpu_memory_utilization of the whole card and leave the others none)
    a = make_engine(models, method, device="cuda", kv_cache_memory_bytes=64 << 20)
    a.export_kv_on_device = True
    h, _ = prefill(a, GREEDY)
    assert h.kv.is_cuda and h.drafter_kv.is_cuda
    b = make_engine(models, method, device="cuda", kv_cache_memory_bytes=64 << 20)
    tokens, _ = decode(b, h)
    reference = make_engine(models, method, device="cuda", kv_cache_memory_bytes=64 << 20)
    reference.add_request("c", PROMPT, GREEDY)
    outs: dict[str, list[int]] = {}
    run_to_end(reference, outs)
    assert tokens == outs["c"]


def test_mismatching_handoff_is_refused(models):
    """Another dtype, block size, target or drafter: HandoffMismatchError naming the field; a
    malformed handoff (drafter state, KV shape) or a used id: InvalidRequestError. Nothing changes
    on the importer."""
    h, _ = prefill(make_engine(models, "draft"), GREEDY)
    cases = [
        (dict(method="draft", dtype="bfloat16"), "dtype"),
        (dict(method="draft", block_size=8), "block_size"),
        (dict(method="draft", target="draft"), "model"),
        (dict(method="eagle"), "drafter_method"),
        (dict(method=None), "drafter_method"),
    ]
    for kwargs, field in cases:
        b = make_engine(models, **kwargs)
        with pytest.raises(HandoffMismatchError, match=rf"\b{field}: exporter"):
            b.import_handoff("d", h)
        assert not b.has_unfinished_requests() and b.handoff_stats.num_imported == 0
        assert_no_leaked_blocks(b)
    b = make_engine(models, "draft")
    bad_state = dataclasses.replace(h, proposer_state=DraftModelState(len(PROMPT) + 5))
    with pytest.raises(InvalidRequestError, match="num_computed"):
        b.import_handoff("d", bad_state)
    bad_kv = dataclasses.replace(h, kv=h.kv[:, :, :2])
    with pytest.raises(InvalidRequestError, match="kv must be"):
        b.import_handoff("d", bad_kv)
    assert not b.has_unfinished_requests()
    assert_no_leaked_blocks(b)
    b.import_handoff("d", h)
    with pytest.raises(InvalidRequestError, match="already in use"):
        b.import_handoff("d", h)
    assert_no_leaked_blocks(b)


@pytest.mark.parametrize("method", [None, "draft", "eagle"])
def test_prefix_cache_hit_on_import(models, method):
    """The second import of the same prompt shares the 2 full prompt blocks B already holds from
    the first and copies only the last; the outputs are the same."""
    expected, _ = colocated(models, method, GREEDY)
    a, b = make_engine(models, method), make_engine(models, method)
    h1, _ = prefill(a, GREEDY, rid="p1")
    h2, _ = prefill(a, GREEDY, rid="p2")
    assert h2.num_cached_tokens == 32  # A's own prefix cache served the second prefill
    first, _ = decode(b, h1, rid="d1")
    assert b.handoff_stats.num_blocks_copied == 3 and b.handoff_stats.num_blocks_cached == 0
    second, _ = decode(b, h2, rid="d2")
    assert b.handoff_stats.num_blocks_copied == 3 + 1 and b.handoff_stats.num_blocks_cached == 2
    assert first == second == expected
    assert_no_leaked_blocks(a)
    assert_no_leaked_blocks(b)


def _snapshot(engine: LLMEngine) -> dict:
    proposer_states = set(engine.speculator.proposer.states) if engine.speculator else set()
    return {
        "stats": {k: v for k, v in engine.stats().items() if k != "spec"},
        "requests": [(r.request_id, list(r.block_ids), r.num_computed_tokens) for r in engine.live_requests()],
        "free": list(engine.block_manager.free_queue),
        "generators": set(engine.runner.generators),
        "draft_probs": set(engine.runner.draft_probs),
        "proposer": proposer_states,
        "cached": dict(engine.block_manager.cached_blocks),
    }


@pytest.mark.parametrize("method", [None, "draft"])
def test_import_when_full_raises_overloaded_and_changes_nothing(models, method):
    """No free blocks (or no free sequence slot): EngineOverloadedError, B unchanged; once the
    running request is done, the same handoff imports and gives the single engine's tokens."""
    expected, _ = colocated(models, method, SAMPLED)
    h, _ = prefill(make_engine(models, method), SAMPLED)
    probe = make_engine(models, method)
    block_bytes = probe.kv_bytes_per_token * 16
    b = make_engine(models, method, kv_cache_memory_bytes=8 * block_bytes, max_model_len=120)
    b.add_request("local", list(range(1, 97)), GREEDY)  # 96 tokens + lookahead: 7 of the 8 blocks
    b.step()
    assert b.block_manager.num_free_blocks < 3
    before = _snapshot(b)
    with pytest.raises(EngineOverloadedError, match="KV blocks"):
        b.import_handoff("d", h)
    assert _snapshot(b) == before
    assert_no_leaked_blocks(b)
    run_to_end(b, {})
    tokens, _ = decode(b, h)
    assert tokens == expected

    one_slot = make_engine(models, method, max_num_seqs=1)
    one_slot.add_request("local", [1, 2, 3], GREEDY)
    one_slot.step()
    before = _snapshot(one_slot)
    with pytest.raises(EngineOverloadedError, match="max_num_seqs"):
        one_slot.import_handoff("d", h)
    assert _snapshot(one_slot) == before
    assert_no_leaked_blocks(one_slot)


@pytest.mark.parametrize("method", [None, "draft"])
def test_request_finishing_on_first_token_is_not_handed_off(models, method):
    """max_tokens=1, or a stop token that is the first token: the request finishes on the prefill
    engine with its own reason and no handoff is made."""
    first, _ = colocated(models, None, SamplingParams(max_tokens=1, temperature=0.0))
    a = make_engine(models, method)
    cases = {
        "len": (SamplingParams(max_tokens=1, temperature=0.0), "length"),
        "stop": (SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=first), "stop"),
    }
    for rid, (params, _) in cases.items():
        a.add_request(rid, PROMPT, params, export_after_prefill=True)
    reasons = {}
    while a.has_unfinished_requests():
        for out in a.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        assert a.take_handoffs() == {}
    assert reasons == {rid: reason for rid, (_, reason) in cases.items()}
    assert a.handoff_stats.num_exported == 0
    assert_no_leaked_blocks(a)


def test_abort_between_execute_and_finish_makes_no_handoff(models):
    a = make_engine(models, "eagle")
    a.add_request("p", PROMPT, GREEDY, export_after_prefill=True)
    outs = a.execute_step()
    assert outs[0].new_token_ids and not outs[0].finished
    a.abort_request("p")
    a.finish_step()
    assert a.take_handoffs() == {}
    assert_no_leaked_blocks(a)


def test_handoff_is_plain_and_frozen(models):
    h, _ = prefill(make_engine(models, "eagle"), SAMPLED)
    for t in (h.kv, h.drafter_kv, h.proposer_state.rows, h.draft_probs, h.generator_state):
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
    with pytest.raises(AttributeError):
        h.num_computed_tokens = 0  # type: ignore[misc]
    assert "Handoff('p'" in repr(h)
