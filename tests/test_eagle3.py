"""EAGLE-3 proposer on tiny random checkpoints written with the published key names and config
fields (SpecForge / EAGLE repo, as vLLM and SGLang read them): its drafts and draft
probabilities equal a reference forward written here from the paper's equations (no cache, the
target's auxiliary features taken from transformers), a missing or mis-shaped key is refused by
name, greedy output equals the target alone, sampled output follows the target's distribution,
and a prefill/decode handoff continues exactly."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch
import transformers
from helpers import assert_each_tensor_is_checked, assert_no_leaked_blocks, ref_attention, save_tiny_model
from helpers import ref_rms as _rms
from helpers import ref_rope as _rope
from safetensors.torch import load_file, save_file
from test_engine import run_staggered
from test_speculative import (
    GREEDY,
    NUM_NEW,
    NUM_SAMPLES,
    SPEC_ARRIVALS,
    SPEC_PROMPTS,
    VOCAB,
    _chi_square_p_value,
    _exact_distribution,
    _sample_counts,
)

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from engine.errors import DrafterMismatchError
from engine.model_runner import ModelRunner
from engine.spec_decode.proposers.eagle3 import Eagle3Proposer, resolve_aux_layer_ids
from kernels import cpu_kernels

NUM_LAYERS = 7  # default aux boundaries (2, L // 2, L - 3) = (2, 3, 4)
H, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, THETA = 64, 4, 2, 16, 128, 1e-5, 10000.0


def save_eagle3(path: str, vocab: int, draft_token_ids: list[int], *, aux_ids=None, embed: bool = False,
                norm_before_residual: bool = False, seed: int = 0, scale: float = 1.0) -> str:
    """A random EAGLE-3 head in the published layout: config.json + model.safetensors."""
    g = torch.Generator().manual_seed(seed)
    n = len(draft_token_ids)

    def rnd(*shape, std=0.08):
        return (torch.randn(*shape, generator=g) * std * scale).contiguous()

    def norm_w():
        return (1.0 + 0.1 * torch.randn(H, generator=g)).contiguous()

    w = {
        "fc.weight": rnd(H, 3 * H, std=0.05),
        "midlayer.input_layernorm.weight": norm_w(),
        "midlayer.hidden_norm.weight": norm_w(),
        "midlayer.self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": norm_w(),
        "midlayer.mlp.gate_proj.weight": rnd(INTER, H),
        "midlayer.mlp.up_proj.weight": rnd(INTER, H),
        "midlayer.mlp.down_proj.weight": rnd(H, INTER),
        "norm.weight": norm_w(),
        "lm_head.weight": rnd(n, H, std=0.3),
        "d2t": torch.tensor(draft_token_ids) - torch.arange(n),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(draft_token_ids), True),
    }
    if embed:
        w["embed_tokens.weight"] = rnd(vocab, H, std=0.3)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA,
        "max_position_embeddings": 512, "vocab_size": vocab, "draft_vocab_size": n, "target_hidden_size": H,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    if norm_before_residual:
        cfg["norm_before_residual"] = True
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(w, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = save_tiny_model(str(root / "target"), "llama", num_hidden_layers=NUM_LAYERS)
    vocab = 97
    ids = sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:64].tolist())
    # default aux layers, the target's embedding | SpecForge-style ids (outputs of layers 1, 3, 6
    # = boundaries 2, 4, 7: the last layer's output before the final norm), its own embedding
    heads = {
        "default": save_eagle3(str(root / "e3a"), vocab, ids),
        "explicit": save_eagle3(str(root / "e3b"), vocab, ids, aux_ids=[1, 3, 6], embed=True,
                                norm_before_residual=True, seed=2),
    }
    base = LLMEngine(target, dtype="float32", device="cpu")
    outs = run_staggered(base, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return {"target": target, "heads": heads, "boundaries": {"default": (2, 3, 4), "explicit": (2, 4, 7)},
            "baseline": [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))]}


# --- the reference: the paper's equations, no cache ------------------------------------------
def _midlayer(w, embeds, feats, norm_before_residual):
    """Output features [m, H] of elements 0..m-1 (element j at RoPE position j), causal."""
    m = embeds.shape[0]
    p = "midlayer."
    normed = _rms(feats, w[p + "hidden_norm.weight"])
    x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"]), normed], -1)
    pos = torch.arange(m)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(m, HEADS, HEAD_DIM), pos, THETA)
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM), pos, THETA)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM)
    attn = ref_attention(q, k, v)
    r = (normed if norm_before_residual else feats) + attn @ w[p + "self_attn.o_proj.weight"].T
    h = _rms(r, w[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
    return r + mlp @ w[p + "mlp.down_proj.weight"].T


def _aux_features(target, token_ids, boundaries):
    """cat of the residual stream at each boundary b (the output of decoder layer b - 1), from
    transformers; b < L is also checked against HF's `output_hidden_states[b]`."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    outs = {}
    hooks = [layer.register_forward_hook(lambda mod, inp, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i, layer in enumerate(ref.model.layers)]
    with torch.no_grad():
        hs = ref.model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    aux = []
    for b in boundaries:
        a = outs[b - 1][0]
        if b < NUM_LAYERS:
            torch.testing.assert_close(a, hs[b][0], rtol=0, atol=0)
        aux.append(a)
    return torch.cat(aux, -1), ref.model.embed_tokens.weight


def reference_drafts(setup, which, token_ids, k, forced=None, temperature=None):
    """Drafts (target ids) and, with a temperature, q [k, vocab] for each draft position; with
    `forced`, the drafted tokens are those (to follow a sampled run)."""
    head_dir = setup["heads"][which]
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(head_dir, "config.json")))
    nbr = cfg.get("norm_before_residual", False)
    aux, target_embed = _aux_features(setup["target"], token_ids, setup["boundaries"][which])
    embed = w.get("embed_tokens.weight", target_embed)
    n = len(token_ids)
    feats = aux[: n - 1] @ w["fc.weight"].T  # g_0..g_{n-2}
    tokens = list(token_ids[1:])  # element j carries token j+1
    target_ids = torch.arange(w["d2t"].shape[0]) + w["d2t"]
    drafts, qs = [], []
    with torch.no_grad():
        for step in range(k):
            out = _midlayer(w, embed[torch.tensor(tokens)], feats, nbr)[-1]
            logits = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
            d = int(target_ids[int(logits.argmax())]) if forced is None else forced[step]
            if temperature is not None:
                qs.append(torch.zeros(embed.shape[0]).index_copy_(0, target_ids, (logits / temperature).softmax(-1)))
            drafts.append(d)
            tokens.append(d)
            feats = torch.cat([feats, out[None]])
    return drafts, (torch.stack(qs) if qs else None)


# --- tests ------------------------------------------------------------------------------------
def test_aux_layer_id_conventions():
    assert resolve_aux_layer_ids({}, 32) == (2, 16, 29)  # the reference default
    assert resolve_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}, 32) == (2, 16, 29)
    # SpecForge's "output of layer X" list [1, L/2 - 1, L - 4]: the same boundaries
    assert resolve_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32) == (2, 16, 29)
    assert resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [3, 5, 7]}, 8) == (3, 5, 7)
    with pytest.raises(DrafterMismatchError, match="within"):
        resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [3, 5, 9]}, 8)


@pytest.mark.parametrize("which", ["default", "explicit"])
def test_drafts_and_q_match_reference(setup, which):
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"][which], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    assert engine.runner.model.aux_layer_ids == setup["boundaries"][which]
    engine.add_request("g", SPEC_PROMPTS[2], GREEDY)
    sampled = SamplingParams(max_tokens=24, temperature=0.7, seed=7, ignore_eos=True)
    engine.add_request("s", SPEC_PROMPTS[0], sampled)
    for _ in range(3):  # prefill + first drafts, then two verifications (incremental KV / features)
        engine.step()
        g, s = engine.scheduler.requests["g"], engine.scheduler.requests["s"]
        assert g.spec_token_ids == reference_drafts(setup, which, g.all_token_ids, 4)[0]
        _, q = reference_drafts(setup, which, s.all_token_ids, 4, forced=list(s.spec_token_ids), temperature=0.7)
        torch.testing.assert_close(engine.runner.draft_probs["s"], q, rtol=1e-4, atol=1e-5)
    assert_no_leaked_blocks(engine)


def finish_checking_drafts(setup, engine, plain, r, tokens: list[int]) -> None:
    """Run `engine` to the end, each of r's drafts equal to the reference's; then the tokens it
    made (with `tokens` before) equal `plain`'s (the target alone) and some drafts were made."""
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        if r.spec_token_ids:
            assert r.spec_token_ids == reference_drafts(setup, "default", r.all_token_ids, len(r.spec_token_ids))[0]
    assert engine.spec_stats.num_draft_tokens > 0
    base: list[int] = []
    while plain.has_unfinished_requests():
        base += [t for out in plain.step() for t in out.new_token_ids]
    assert tokens == base


@pytest.mark.parametrize("bound", [None, 24])
def test_midlayer_waits_while_speculation_is_off(setup, bound, monkeypatch):
    """Speculation forced off for 30 steps after a prompt longer than the fused kernels take: with
    the lazy bound (feature_buffers.LAZY_BUFFER_ROWS) the midlayer never runs meanwhile and the request
    buffers every row; with a small bound (24) it catches up whenever the buffer passes it. Turned
    back on, the first round catches up over what waits (a long catch-up first, on its own) and
    its drafts equal the reference's over the whole context, then each later round's do too, and
    the output equals the target alone's; that catch-up's time is recorded (`record_catch_up`)."""
    from engine.spec_decode.proposers.eagle3 import FUSED_MAX_ROWS
    from engine.spec_decode.proposers.feature_buffers import LAZY_BUFFER_ROWS

    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_seqs=4)
    plain = LLMEngine(setup["target"], dtype="float32", device="cpu")
    proposer = engine.speculator.proposer
    assert proposer.steady_rows == 16 and proposer.max_buffered_rows == LAZY_BUFFER_ROWS
    if bound is not None:
        proposer.max_buffered_rows = bound
    forwards = []
    real = proposer._forward
    monkeypatch.setattr(proposer, "_forward", lambda m, chunks, *a, **kw: forwards.append(
        sum(len(c.token_ids) for c in chunks)) or real(m, chunks, *a, **kw))
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 0)
    prompt = [(7 * i + 3) % 90 + 3 for i in range(FUSED_MAX_ROWS + 20)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    plain.add_request("r", prompt, params)
    r = engine.scheduler.requests["r"]
    tokens: list[int] = []
    for _ in range(30):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        rows = proposer.states["r"].rows.shape[0]
        assert rows <= proposer.max_buffered_rows
        if bound is None:
            assert rows == r.num_tokens - 1
    assert (not forwards) if bound is None else forwards
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 4)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))
    recorded = len(proposer._catch_up_row_s or ())
    finish_checking_drafts(setup, engine, plain, r, tokens)
    assert_no_leaked_blocks(engine)
    if bound is None:  # the long catch-up was timed: the policy prices the next one by it (a debt)
        assert len(proposer._catch_up_row_s) == recorded + 1 and proposer.catch_up_seconds(100) > 0


def test_decode_rows_wait_unprojected_until_their_request_is_read(setup, monkeypatch):
    """On the CPU row kernels a decode step's auxiliary rows wait unprojected: with speculation
    off no fc runs at all; a request that finishes or is aborted meanwhile leaves without its rows
    ever projected; a read of one request's buffer (its draft) projects its rows only, the
    others' keep waiting; a read of all (`states`) projects every live request's rows, which
    are then buffered in order; the waiting steps never pass the buffer bound; turned back on,
    the drafts equal the reference's."""
    from kernels import cpu_kernels

    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_seqs=4)
    proposer = engine.speculator.proposer
    if not proposer.row_kernel:
        pytest.skip("no CPU row kernels")
    projected = []
    real = cpu_kernels.packed_linear
    monkeypatch.setattr(cpu_kernels, "packed_linear", lambda x, packed, *a: (projected.append(
        x.shape[0]) if packed is proposer.packed_fc else None) or real(x, packed, *a))
    drafting: set[str] = set()
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 4 if request.request_id in drafting else 0)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request("long", SPEC_PROMPTS[0], params)
    engine.add_request("short", SPEC_PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_request("other", SPEC_PROMPTS[2], params)
    engine.step()  # the prompts' prefill: projected at once
    assert len(projected) == 1
    for _ in range(15):
        engine.step()
    long, other = engine.scheduler.requests["long"], engine.scheduler.requests["other"]
    assert len(projected) == 1 and len(proposer._deferred) == 15
    assert proposer.pending_rows(long) == long.num_tokens - 1 and len(projected) == 1  # counted, not projected
    assert all(e[0].request_id != "short" for _, entries in proposer._deferred for e in entries)  # finished: dropped
    drafting.add("long")
    engine.step()  # long drafts: its 16 waiting rows are projected, other's keep waiting
    assert projected[1:] == [16] and long.spec_token_ids
    assert long.spec_token_ids == reference_drafts(setup, "default", long.all_token_ids, len(long.spec_token_ids))[0]
    assert proposer.pending_rows(other) == other.num_tokens - 1 and len(proposer._deferred) == 16
    assert proposer.pending_rows_of([other, long]) == [proposer.pending_rows(other), proposer.pending_rows(long)]
    engine.abort_request("other")
    assert all(e[0].request_id != "other" for _, entries in proposer._deferred for e in entries)
    drafting.clear()
    projected.clear()
    for _ in range(3):
        engine.step()
    assert projected == []
    assert proposer.states["long"].end == long.num_tokens - 1  # a read of all: every row, in order
    assert projected == [3]
    proposer.max_buffered_rows = 8  # the waiting steps stay within the bound
    for _ in range(20):
        engine.step()
        assert len(proposer._deferred) < 8
    drafting.add("long")
    while engine.has_unfinished_requests():
        engine.step()
        if long.spec_token_ids and not long.is_finished:
            assert long.spec_token_ids == reference_drafts(setup, "default", long.all_token_ids, len(long.spec_token_ids))[0]
    engine.speculator.check_no_leaks(engine.scheduler.running)
    assert not proposer._deferred and not proposer.states


def test_a_draft_that_fails_after_its_waiting_rows_were_projected_leaves_them_buffered(setup, monkeypatch):
    """Speculation off for 12 steps (the rows wait unprojected), then the first draft projects
    them and its chain call raises: the step goes on without drafts, the rows stay buffered in
    order (none lost, none twice), the next draft equals the reference's and the output equals
    the target alone's."""
    from kernels import cpu_kernels

    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    plain = LLMEngine(setup["target"], dtype="float32", device="cpu")
    proposer = engine.speculator.proposer
    if not proposer.row_kernel:
        pytest.skip("no CPU row kernels")
    on = [False]
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 4 if on[0] else 0)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))
    real, failed = cpu_kernels.draft_chain, []

    def fail_once(*a, **kw):
        if not failed:
            failed.append(1)
            raise RuntimeError("injected drafting failure")
        return real(*a, **kw)

    monkeypatch.setattr(cpu_kernels, "draft_chain", fail_once)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("r", SPEC_PROMPTS[0], params)
    plain.add_request("r", SPEC_PROMPTS[0], params)
    r = engine.scheduler.requests["r"]
    tokens: list[int] = []
    for _ in range(12):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert proposer._deferred
    on[0] = True
    tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert failed and not r.spec_token_ids and not proposer._deferred
    assert proposer.states["r"].end == r.num_tokens - 1
    finish_checking_drafts(setup, engine, plain, r, tokens)
    engine.speculator.check_no_leaks(engine.scheduler.running)


@pytest.mark.slow  # make test-fast skips it
def test_a_cached_prefix_is_reused_only_where_the_midlayer_filled_its_kv(setup, monkeypatch):
    """Prefix caching skips the target over cached blocks, so the midlayer (which runs only over
    the target's rows) must find its own KV there. A request that did not run it over them
    (speculative=False, or speculation off until it finished: its rows waited) leaves blocks a
    drafting request does not reuse: it recomputes them, and its drafts equal the reference's. A
    request whose midlayer covered them leaves blocks that are reused, with the same drafts."""
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_seqs=4)
    prompt = [(5 * i + 2) % 90 + 3 for i in range(40)]  # two full blocks of 16 to share

    def run(rid, tokens, params, check_drafts=True):
        engine.add_request(rid, tokens, params)
        r = engine.scheduler.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
            if check_drafts and r.spec_token_ids and not r.is_finished:
                assert r.spec_token_ids == reference_drafts(setup, "default", r.all_token_ids, len(r.spec_token_ids))[0]
        assert_no_leaked_blocks(engine)
        return r

    def drafting(on: bool) -> None:
        monkeypatch.setattr(engine.speculator, "choose_k",
                            lambda request, step_index: engine.speculator.max_k(request) if on else 0)
        monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))

    drafting(True)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, speculative=False)
    assert run("a", prompt + [7], plain, check_drafts=False).num_cached_tokens == 0
    # the disaggregation probe (engine.num_cached_prompt_tokens) says what admission then does
    assert engine.num_cached_prompt_tokens(prompt + [8], GREEDY) == 0
    assert engine.num_cached_prompt_tokens(prompt + [8], plain) == 32
    b = run("b", prompt + [8], GREEDY)  # a's blocks hold no midlayer KV: recomputed
    assert b.num_cached_tokens == 0 and engine.spec_stats.num_draft_tokens > 0
    assert engine.num_cached_prompt_tokens(prompt + [9], GREEDY) == 32
    assert run("c", prompt + [9], GREEDY).num_cached_tokens == 32  # b's hold it: reused
    drafting(False)
    run("d", prompt[::-1] + [7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))  # rows wait, then it ends
    drafting(True)
    assert run("e", prompt[::-1] + [8], GREEDY).num_cached_tokens == 0
    assert run("f", prompt[::-1] + [9], GREEDY).num_cached_tokens == 32
    plain_engine = LLMEngine(setup["target"], dtype="float32", device="cpu")
    assert plain_engine.scheduler.prefix_filter is None


@pytest.mark.parametrize("which", ["default", "explicit"])
def test_greedy_chain_kernel_drafts_match_reference(setup, which, monkeypatch):
    """Greedy requests only: the CPU path drafts a whole chain in one kernel call
    (cpu_kernels.draft_chain: catch-up, every draft, the head's KV written); its drafts equal the
    reference at every step, which also checks the KV it wrote (the next catch-up reads it)."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    calls = []
    real = cpu_kernels.draft_chain
    monkeypatch.setattr(cpu_kernels, "draft_chain", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"][which], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    engine.add_request("a", SPEC_PROMPTS[2], GREEDY)
    engine.add_request("b", SPEC_PROMPTS[0], GREEDY)
    for _ in range(4):
        engine.step()
        for rid in ("a", "b"):
            r = engine.scheduler.requests[rid]
            assert r.spec_token_ids == reference_drafts(setup, which, r.all_token_ids, 4)[0]
    assert len(calls) == 4
    assert_no_leaked_blocks(engine)


def test_chain_kernel_samples_as_the_python_loop(setup, monkeypatch):
    """Sampled requests (temperature, top-k, top-p) draft through the one-call chain kernel too:
    with the same seeded generators its drafts equal the Python loop's, round after round, its q
    (the distribution each draft was drawn from, zero off the draft vocabulary) equals the loop's
    to float32 rounding, and so the outputs are the same; a greedy request beside them too."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    sampled_calls = []
    real = cpu_kernels.draft_chain
    monkeypatch.setattr(cpu_kernels, "draft_chain", lambda *a, **kw: sampled_calls.append(a[-2] is not None)
                        or real(*a, **kw))
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=False)
    sampled = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=1.0, seed=12, ignore_eos=True), GREEDY]
    runs = []
    for chain in (True, False):
        engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
        engine.speculator.proposer.row_kernel_chain = chain
        for i, params in enumerate(sampled):
            engine.add_request(f"r{i}", SPEC_PROMPTS[i], params)
        runs.append(_drafts_per_step(engine))
    assert _same_drafts(*runs) > 5 and sum(sampled_calls) > 5


# sampled requests (temperature, top-k, top-p) and a greedy one, for the tree kernels' tests
TREE_KERNEL_PARAMS = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
                      SamplingParams(max_tokens=20, temperature=1.0, seed=12, ignore_eos=True),
                      SamplingParams(max_tokens=20, temperature=1.0, top_k=2, seed=13, ignore_eos=True), GREEDY]


def kernel_and_loop_trees(make_engine, switch: str, prompts: list) -> list:
    """`_drafts_per_step` of TREE_KERNEL_PARAMS (request i: prompts[i]) on two engines from
    make_engine(): the proposer's `switch` attribute True (the one-call tree kernel), then False
    (the Python level loop); request widths 3, 2, 3, 1 (the policy's per-request widths) forced
    into one batch."""
    runs = []
    for kernel in (True, False):
        engine = make_engine()
        proposer = engine.speculator.proposer
        setattr(proposer, switch, kernel)
        proposer.propose_trees = functools.partial(
            lambda real, reqs, n, d, ctx, widths=None: real(reqs, n, d, ctx, [[3, 2, 3, 1][int(r.request_id[1:])]
                                                                               for r in reqs]),
            proposer.propose_trees)
        for i, p in enumerate(TREE_KERNEL_PARAMS):
            engine.add_request(f"r{i}", prompts[i], p)
        runs.append(_drafts_per_step(engine))
        assert_no_leaked_blocks(engine)
    return runs


def _drafts_per_step(engine: LLMEngine) -> tuple[list[dict], dict]:
    """Run the engine's requests to the end: (per step, request id -> (drafts, their q, the
    tree's parents or None)), (request id -> output tokens)."""
    seen, outs = [], {rid: [] for rid in engine.scheduler.requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        seen.append({rid: (list(r.spec_token_ids), engine.runner.draft_probs.get(rid),
                           None if r.spec_tree is None else r.spec_tree.parents)
                     for rid, r in engine.scheduler.requests.items()})
    return seen, outs


def _same_drafts(kernel: tuple[list[dict], dict], loop: tuple[list[dict], dict]) -> int:
    """Two `_drafts_per_step` runs have the same outputs, drafts and trees at every step, and
    each draft's q to float32 rounding; returns how many q were compared."""
    (seen_k, outs_k), (seen_l, outs_l) = kernel, loop
    assert outs_k == outs_l
    assert [{rid: (d, t) for rid, (d, _, t) in step.items()} for step in seen_k] == \
        [{rid: (d, t) for rid, (d, _, t) in step.items()} for step in seen_l]
    compared = 0
    for step_k, step_l in zip(seen_k, seen_l, strict=True):
        for rid, (_, q, _) in step_k.items():
            if q is not None:
                torch.testing.assert_close(q, step_l[rid][1], rtol=1e-4, atol=1e-6)
                assert q.sum(-1).sub(1).abs().max() < 1e-4
                compared += 1
            else:
                assert step_l[rid][1] is None
    return compared


def test_tree_kernel_samples_as_the_python_loop(setup, monkeypatch):
    """Sampled requests draft their trees through the one-call tree kernel too
    (`cpu_kernels.draft_tree` with `sampling`): with the same seeded generators (both read the
    uniforms in `TreeUniforms`' order) every round's trees equal the Python level loop's (tokens
    and parents), each node's q (the distribution it was drawn from, zero off the draft
    vocabulary) equals the loop's to float32 rounding, and so the outputs are the same; a greedy
    request beside them too, and requests of different widths (the adaptive policy's) in one
    batch."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    sampled_calls = []
    real = cpu_kernels.draft_tree
    monkeypatch.setattr(cpu_kernels, "draft_tree", lambda *a, **kw: sampled_calls.append(a[-2] is not None)
                        or real(*a, **kw))
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4,
                             adaptive=False, tree_nodes=7, tree_width=3, tree_depth=4)
    runs = kernel_and_loop_trees(lambda: LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec),
                                 "row_kernel_chain", SPEC_PROMPTS * 2)
    assert _same_drafts(*runs) > 5 and sum(sampled_calls) > 5
    # the trees were trees (some node with two children), for the sampled requests too
    assert any(len(t) > len(set(t)) for step in runs[0][0] for _, q, t in step.values() if q is not None and t)


def test_greedy_chain_kernel_refuses_inputs_it_cannot_serve(setup):
    """draft_chain checks what it is given before it writes anything: a chain that would run past
    the request's block table, a request without rows, rows out of request order."""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    p = engine.speculator.proposer
    k_cache, v_cache = p.kv_caches[0]
    before = k_cache.clone()
    h, bs = p.arch.hidden_size, k_cache.shape[1]
    norms = {"in_ln": torch.ones(h), "hidden_norm": torch.ones(h), "final_norm": torch.ones(h)}

    def call(positions, owner, tables, drafts, sampling=None, uniforms=None):
        n = len(positions)
        return cpu_kernels.draft_chain(
            torch.zeros(n, h), torch.zeros(n, dtype=torch.int64), torch.tensor(positions), torch.tensor(owner),
            torch.tensor(tables), torch.tensor(drafts), p.embed_tokens.weight, norms, False, p.layer.row_weights(),
            p.head.packed, p.head.size, p.head.token_ids, p.rope_f32, k_cache, v_cache, p.arch.num_heads,
            p.arch.num_kv_heads, p.arch.intermediate_size, 1e-5, 0.25, False, sampling, uniforms)[0]

    with pytest.raises(RuntimeError, match="beyond its block table"):
        call([bs - 2], [0], [[1]], [4])  # positions bs - 1 .. bs + 1 need a second block
    with pytest.raises(RuntimeError, match="has no rows"):
        call([0], [0], [[1], [2]], [1, 1])
    with pytest.raises(RuntimeError, match="request order"):
        call([0, 0], [1, 0], [[1], [2]], [1, 1])
    with pytest.raises(RuntimeError, match="top_p outside"):
        call([0], [0], [[1]], [2], torch.tensor([[0.7, 0.0, 1.5]]), torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="uniforms float32"):
        call([0], [0], [[1]], [3], torch.tensor([[0.7, 0.0, 1.0]]), torch.zeros(1, 2))  # 2 uniforms, 3 drafts
    assert torch.equal(k_cache, before)


def test_greedy_chain_kernel_equals_the_python_loop_bfloat16(setup):
    """bfloat16 (with its own embedding and norm_before_residual): the kernel's drafts equal
    the Python loop's, round after round. (This tiny head has no near-ties, so it passes without
    the kernel's bfloat16 rounding too; the shipped models' test,
    test_shipped_eagle3_kernel_chain_drafts_equal_the_python_loop, does not.)"""
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU row kernels")
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["explicit"], num_speculative_tokens=4, adaptive=False)
    engines = [LLMEngine(setup["target"], dtype="bfloat16", device="cpu", speculative=spec) for _ in range(2)]
    engines[1].speculator.proposer.row_kernel_chain = False  # the Python loop
    drafts: list[list[list[int]]] = [[], []]
    for engine, seen in zip(engines, drafts, strict=True):
        engine.add_request("r", SPEC_PROMPTS[1], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
            r = engine.scheduler.requests.get("r")
            if r is not None:
                seen.append(list(r.spec_token_ids))
    assert drafts[0] == drafts[1] and sum(map(len, drafts[0])) > 0


@pytest.mark.parametrize("k,adaptive", [(3, False), (5, True)])
def test_greedy_output_equals_target_float32(setup, k, adaptive):
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=k, adaptive=adaptive)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64)
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == setup["baseline"]
    if not adaptive:
        assert engine.spec_stats.num_draft_tokens > 0


QUANT_HEADS = cpu_kernels.available() and (cpu_kernels.int8_available() or cpu_kernels.gguf_available())
INT8, INT4 = (pytest.param(q, marks=pytest.mark.skipif(
    not QUANT_HEADS, reason=f"{q} drafter products need the CPU row kernels and AVX512-VNNI or AVX2 with F16C"))
    for q in ("int8", "int4"))
# the packed copies' dtype: int8 rows (VNNI) or bytes (int4 and the GGUF blocks elsewhere)
QUANT_DTYPE = {"int8": torch.int8 if cpu_kernels.int8_available() else torch.uint8, "int4": torch.uint8}


@pytest.fixture
def gguf_blocks(monkeypatch):
    """The quantized head's copies as GGUF blocks (what a CPU without AVX512-VNNI packs) on any
    CPU whose row kernels run the GGUF products."""
    if not (cpu_kernels.available() and cpu_kernels.gguf_available()):
        pytest.skip("GGUF block products need the CPU row kernels and F16C")
    monkeypatch.setattr(cpu_kernels, "int8_available", lambda: False)


@pytest.mark.parametrize("draft_weights,blocks", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantized_head_as_gguf_blocks(gguf_blocks, draft_weights, blocks):
    """Without AVX512-VNNI a quantized head's matrix is quantized into GGUF blocks (the gguf
    package's quantizer) and run by the GGUF products: the products of the matrix the blocks
    dequantize to, within float rounding, and close to the head's own."""
    import gguf.quants

    from engine.spec_decode.proposers.eagle3_packing import pack_quantized, quant_layout

    assert quant_layout(draft_weights) == blocks and quant_layout("model") == "model"
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(136, 96, generator=g) * 0.05).to(torch.bfloat16)  # rows past a block of 64
    x = torch.randn(3, 96, generator=g)
    packed = pack_quantized(w, draft_weights)
    assert packed.dtype == torch.uint8 and packed.dim() == 3
    kind = gguf.GGMLQuantizationType[blocks]
    deq = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), kind), kind))
    y = cpu_kernels.packed_linear(x, packed, w.shape[0], None)
    torch.testing.assert_close(y, x @ deq.T, rtol=1e-3, atol=1e-3)
    error = (y - x @ w.float().T).abs().max() / (x @ w.float().T).abs().max()
    assert 0 < error < (0.01 if blocks == "Q8_0" else 0.1)


def one_at_a_time_equals_target(setup, draft_weights: str):
    """Batch 1, bfloat16: the first two prompts one at a time through the target alone and with
    the explicit-vocabulary head at k = 4 (`draft_weights`), token for token; the head's proposer."""
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["explicit"], num_speculative_tokens=4, adaptive=False,
                             draft_weights=draft_weights)
    plain = LLMEngine(setup["target"], dtype="bfloat16", device="cpu")
    spec_engine = LLMEngine(setup["target"], dtype="bfloat16", device="cpu", speculative=spec)
    for i, prompt in enumerate(SPEC_PROMPTS[:2]):
        results = []
        for engine in (plain, spec_engine):
            engine.add_request(f"r{i}", prompt, GREEDY)
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.extend(out.new_token_ids)
            assert_no_leaked_blocks(engine)
            results.append(tokens)
        assert results[0] == results[1]
    assert spec_engine.spec_stats.num_draft_tokens > 0
    return spec_engine.speculator.proposer


@pytest.mark.parametrize("draft_weights", ["int8", "int4"])
def test_greedy_output_equals_target_with_gguf_block_head(setup, gguf_blocks, draft_weights):
    """The head's copies as GGUF blocks: greedy speculative output equals the target's, and every
    drafting product takes the blocks (this CPU has no AMX tiles to prefer bfloat16 ones)."""
    proposer = one_at_a_time_equals_target(setup, draft_weights)
    one_row = proposer._packing(1)
    assert one_row[1].dim() == one_row[0]["w_qkv"].dim() == one_row[2].dim() == 3  # GGUF records
    assert proposer._packing(64)[1].dim() == (2 if cpu_kernels.amx_available() else 3)


@pytest.mark.parametrize("draft_weights", ["model", INT8, INT4])
def test_greedy_output_equals_target_bfloat16(setup, draft_weights):
    """Batch 1 (the exactness guarantee): one request at a time, token for token; with the head's
    weights as the checkpoint has them, as int8 and as int4 (SpeculativeConfig.draft_weights)."""
    proposer = one_at_a_time_equals_target(setup, draft_weights)
    assert proposer.draft_weights == draft_weights
    one_row, many_rows = proposer._packing(1), proposer._packing(64)
    quant = QUANT_DTYPE.get(draft_weights)
    assert one_row[1].dtype == one_row[0]["w_qkv"].dtype == one_row[2].dtype == (quant or torch.bfloat16)
    # past a few rows the bfloat16 copies where AMX tiles run them (a prompt's catch-up)
    assert many_rows[1].dtype == (quant if quant and not cpu_kernels.amx_available() else torch.bfloat16)


def test_draft_weights_are_checked(setup):
    """Only "auto", "model", "int8" and "int4"; the quantized ones for EAGLE-3 only; "auto" keeps a
    float32 head's dtype; int8 or int4 where the kernels cannot run them is refused at start-up."""
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], draft_weights="fp8")
    for quant in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"draft_weights='{quant}' applies to method 'eagle3' only"):
            SpeculativeConfig(method="draft", model=setup["target"], draft_weights=quant)
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], num_speculative_tokens=2)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    assert engine.speculator.proposer.draft_weights == "model"
    if not QUANT_HEADS:
        with pytest.raises(ValueError, match="needs the CPU row kernels"):
            LLMEngine(setup["target"], dtype="float32", device="cpu",
                      speculative=SpeculativeConfig(method="eagle3", model=setup["heads"]["default"], draft_weights="int8"))


@pytest.mark.skipif(not QUANT_HEADS, reason="quantized drafter products need the CPU row kernels and AVX512-VNNI or AVX2")
def test_int4_needs_matrices_a_multiple_of_32_wide(setup, tmp_path, monkeypatch):
    """A head whose MLP is 80 wide (down_proj's inputs): draft_weights='int4' is refused at
    start-up naming the widths; 'auto' (int4 where it can) packs it as int8 instead where the CPU
    has AVX512-VNNI (a scale per row), else keeps the head's dtype (GGUF's Q8_0 blocks are 32
    wide too, so 'int8' is refused there)."""
    monkeypatch.setattr(sys.modules[__name__], "INTER", 80)
    head = save_eagle3(str(tmp_path / "e3_80"), 97, list(range(0, 96, 3)))
    with pytest.raises(ValueError, match=r"int4.*multiple of 32 wide, got .*80"):
        LLMEngine(setup["target"], dtype="bfloat16", device="cpu",
                  speculative=SpeculativeConfig(method="eagle3", model=head, draft_weights="int4"))
    engine = LLMEngine(setup["target"], dtype="bfloat16", device="cpu",
                       speculative=SpeculativeConfig(method="eagle3", model=head, draft_weights="auto"))
    proposer = engine.speculator.proposer
    if cpu_kernels.int8_available():
        assert proposer.draft_weights == "int8"
        assert proposer._packing(1)[1].dtype == torch.int8
    else:
        assert proposer.draft_weights == "model"
        assert proposer._packing(1)[1].dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"'int8' \(Q8_0\).*multiple of 32 wide, got .*80.*use 'model'"):
            LLMEngine(setup["target"], dtype="bfloat16", device="cpu",
                      speculative=SpeculativeConfig(method="eagle3", model=head, draft_weights="int8"))


def test_packed_catch_up_matches_the_torch_midlayer_bfloat16(setup):
    """Where torch emulates bfloat16 products (no AVX512-BF16/AMX), the midlayer's catch-up over
    more rows than the fused row path takes (a prompt's) runs its matmuls through the packed CPU
    kernel: the same features as torch's bfloat16 forward, to bfloat16 rounding."""
    from engine.model_runner import SeqChunk
    from engine.spec_decode.proposers.eagle3 import FUSED_MAX_ROWS
    from kernels import cpu_kernels

    if not (cpu_kernels.available() and cpu_kernels.emulated_bf16()):
        pytest.skip("the packed catch-up is used only where torch emulates bfloat16 products")
    spec = SpeculativeConfig(method="eagle3", model=setup["heads"]["explicit"], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="bfloat16", device="cpu", speculative=spec)
    proposer = engine.speculator.proposer
    assert proposer.layer.packed_matmuls
    prompt = [(7 * i) % 90 + 3 for i in range(FUSED_MAX_ROWS + 12)]
    engine.add_request("r", prompt, GREEDY)
    engine.step()  # prefill: the request's blocks exist
    r = engine.scheduler.requests["r"]
    n = len(prompt) - 2
    feats = torch.randn(n, proposer.arch.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    chunk = [SeqChunk([0] * n, 0, r.block_ids)]
    packed = proposer._forward(0, chunk, prompt[1 : n + 1], feats)
    proposer.layer.packed_matmuls = False
    plain = proposer._forward(0, chunk, prompt[1 : n + 1], feats)
    proposer.layer.packed_matmuls = True
    torch.testing.assert_close(packed.float(), plain.float(), rtol=3e-2, atol=3e-2)
    assert not torch.equal(packed, torch.zeros_like(packed))


def test_missing_or_misshaped_key_is_refused(setup, tmp_path):
    runner = ModelRunner(setup["target"], torch.device("cpu"), torch.float32, 128)
    src = setup["heads"]["default"]
    Eagle3Proposer(src, runner)  # the intact checkpoint loads
    weights = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    # t2d is optional (vLLM ignores it); checked when present
    assert_each_tensor_is_checked(lambda d: Eagle3Proposer(d, runner), weights, cfg, tmp_path, optional=("t2d",))


def test_mismatched_target_is_refused(setup, tmp_path):
    other = save_tiny_model(str(tmp_path / "small"), "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=7)
    with pytest.raises(DrafterMismatchError, match="target_hidden_size 64"):
        LLMEngine(other, dtype="float32", device="cpu",
                  speculative=SpeculativeConfig(method="eagle3", model=setup["heads"]["default"]))


@pytest.mark.parametrize("draft_weights", ["model", INT8, INT4])
@pytest.mark.slow  # make test-fast skips it
def test_sampled_distribution_matches_target(tmp_path, draft_weights):
    """Chi-square test of 3000 samples of (x1..x4) against the exact target distribution; fails
    when p < 1e-4 (false-failure probability 1e-4 per case; fixed seed, so reproducible). The head
    drafts over 2 of the 3 tokens (d2t), so q is zero on the third. int8 / int4: the head's weights
    quantized (its q from those products; the target's distribution all the same)."""
    target = save_tiny_model(str(tmp_path / "t"), "llama", vocab_size=VOCAB, num_hidden_layers=NUM_LAYERS)
    head = save_eagle3(str(tmp_path / "e3"), VOCAB, [0, 2], seed=3, scale=3.0)
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, top_k=2, ignore_eos=True)
    spec = SpeculativeConfig(method="eagle3", model=head, num_speculative_tokens=3, adaptive=False,
                             draft_weights=draft_weights)
    counts, stats = _sample_counts(target, spec, params, prompt)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p > 1e-4, f"p={p:.2e}"


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_handoff_equals_colocated(setup, params):
    from test_handoff import GREEDY as H_GREEDY
    from test_handoff import PROMPT, SAMPLED, assert_handoff_equals_colocated

    models = {"target": setup["target"], "eagle3": setup["heads"]["default"]}
    h = assert_handoff_equals_colocated(models, "eagle3", H_GREEDY if params == "greedy" else SAMPLED)
    assert h.num_computed_tokens == len(PROMPT) and h.drafter_kv is not None and h.proposer_state is not None
    # the prefill replica ran the midlayer over the prompt (the steady bound, not the lazy one)
    assert h.proposer_state.rows.shape[0] <= 16 < len(PROMPT)
