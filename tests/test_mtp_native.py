"""Native MTP proposer on tiny random targets whose checkpoints carry MTP layers with the
published key names and config fields (DeepSeek-V3: `model.layers.{L + i}.*`; MiMo:
`model.mtp_layers.{i}.*`, as vLLM reads them): drafts and draft probabilities equal a reference
forward written here from the equations (no cache; the target's features from transformers), a
missing or mis-shaped key is refused by name, greedy output equals the target alone, sampled
output follows the target's distribution, and a prefill/decode handoff continues exactly."""

from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import torch
import transformers
from helpers import assert_each_tensor_is_checked, assert_no_leaked_blocks, ref_attention, save_tiny_model
from helpers import ref_rms as rms
from helpers import ref_rope as rope
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
from engine.spec_decode.proposers.mtp import MTPProposer

H, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, THETA = 64, 4, 2, 16, 128, 1e-5, 10000.0
NUM_LAYERS = 2  # the tiny targets' decoder layers (helpers.TINY)


# --- tiny checkpoints ---------------------------------------------------------------------------
def _random(g: torch.Generator, scale: float):
    def rnd(*shape, std=0.08):
        return (torch.randn(*shape, generator=g) * std * scale).contiguous()

    def norm_w():
        return (1.0 + 0.1 * torch.randn(H, generator=g)).contiguous()

    return rnd, norm_w


def decoder_layer_tensors(rnd, norm_w, prefix: str, bias: bool) -> dict[str, torch.Tensor]:
    """One Hugging Face decoder layer (Llama; Qwen2 with q/k/v biases)."""
    w = {
        "input_layernorm.weight": norm_w(),
        "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, H),
        "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, H),
        "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, H),
        "self_attn.o_proj.weight": rnd(H, HEADS * HEAD_DIM),
        "post_attention_layernorm.weight": norm_w(),
        "mlp.gate_proj.weight": rnd(INTER, H),
        "mlp.up_proj.weight": rnd(INTER, H),
        "mlp.down_proj.weight": rnd(H, INTER),
    }
    if bias:
        w |= {
            f"self_attn.{n}_proj.bias": rnd(size, std=0.02)
            for n, size in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM))
        }
    return {prefix + k: v for k, v in w.items()}


def add_mtp_layers(
    target: str,
    layout: str,
    num_modules: int,
    *,
    own_head: bool = False,
    embed_copy: bool = False,
    seed: int = 0,
    scale: float = 1.0,
) -> str:
    """Write MTP layers into a `save_tiny_model` checkpoint in the published layout: DeepSeek-V3
    (optionally with its own shared_head.head and a copy of the target's embedding, as DeepSeek-V3
    stores them) or MiMo (the config becomes MiMoForCausalLM)."""
    g = torch.Generator().manual_seed(seed)
    rnd, norm_w = _random(g, scale)
    path = os.path.join(target, "model.safetensors")
    w = load_file(path)
    vocab = w["lm_head.weight"].shape[0]
    for m in range(num_modules):
        if layout == "deepseek":
            p = f"model.layers.{NUM_LAYERS + m}."
            w |= {
                p + "enorm.weight": norm_w(),
                p + "hnorm.weight": norm_w(),
                p + "eh_proj.weight": rnd(H, 2 * H, std=0.1),
                p + "shared_head.norm.weight": norm_w(),
            }
            if own_head:
                w[p + "shared_head.head.weight"] = rnd(vocab, H, std=0.3)
            if embed_copy:
                w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
            w |= decoder_layer_tensors(rnd, norm_w, p, bias=False)
        else:
            p = f"model.mtp_layers.{m}."
            w |= {
                p + "token_layernorm.weight": norm_w(),
                p + "hidden_layernorm.weight": norm_w(),
                p + "input_proj.weight": rnd(H, 2 * H, std=0.1),
                p + "final_layernorm.weight": norm_w(),
            }
            w |= decoder_layer_tensors(rnd, norm_w, p, bias=True)
    save_file(w, path, metadata={"format": "pt"})
    cfg_path = os.path.join(target, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["num_nextn_predict_layers"] = num_modules
    if layout == "mimo":
        cfg["architectures"], cfg["model_type"] = ["MiMoForCausalLM"], "mimo"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return target


LAYOUTS = {  # name -> (family, layout, modules, own head, embedding copy)
    "deepseek1": ("llama", "deepseek", 1, True, True),
    "deepseek2": ("llama", "deepseek", 2, False, False),
    "mimo": ("qwen2", "mimo", 1, False, False),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, (family, layout, n, own_head, embed) in LAYOUTS.items():
        target = save_tiny_model(str(root / name), family)
        out[name] = add_mtp_layers(target, layout, n, own_head=own_head, embed_copy=embed, seed=len(out))
    return out


# --- the reference: the equations, no cache -----------------------------------------------------
def decoder_layer(w, p, x, positions, input_norm: bool = True):
    """A pre-norm decoder layer on elements x [m, H] at RoPE `positions`, causal: its residual stream."""
    m = x.shape[0]
    h = rms(x, w[p + "input_layernorm.weight"]) if input_norm else x

    def proj(name, heads):
        y = h @ w[p + f"self_attn.{name}_proj.weight"].T
        if p + f"self_attn.{name}_proj.bias" in w:
            y = y + w[p + f"self_attn.{name}_proj.bias"]
        return y.view(m, heads, HEAD_DIM)

    q, k, v = rope(proj("q", HEADS), positions), rope(proj("k", KV_HEADS), positions), proj("v", KV_HEADS)
    r = x + ref_attention(q, k, v) @ w[p + "self_attn.o_proj.weight"].T
    g = rms(r, w[p + "post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(g @ w[p + "mlp.gate_proj.weight"].T) * (g @ w[p + "mlp.up_proj.weight"].T)
    return r + mlp @ w[p + "mlp.down_proj.weight"].T


def mtp_module(w, layout, m, embeds, feats):
    """Module m on elements (embeds[j], feats[j]) at positions 0..: (output features, logits input)."""
    pos = torch.arange(embeds.shape[0])
    if layout == "deepseek":
        p = f"model.layers.{NUM_LAYERS + m}."
        x = (
            torch.cat([rms(embeds, w[p + "enorm.weight"]), rms(feats, w[p + "hnorm.weight"])], -1)
            @ w[p + "eh_proj.weight"].T
        )
        out = decoder_layer(w, p, x, pos)
        return out, rms(out, w[p + "shared_head.norm.weight"])
    p = f"model.mtp_layers.{m}."
    x = torch.cat(
        [rms(feats, w[p + "hidden_layernorm.weight"]), rms(embeds, w[p + "token_layernorm.weight"])], -1
    )
    out = rms(decoder_layer(w, p, x @ w[p + "input_proj.weight"].T, pos), w[p + "final_layernorm.weight"])
    return out, out


@functools.cache
def reference_model(target: str, layout: str):
    cls = transformers.Qwen2ForCausalLM if layout == "mimo" else transformers.AutoModelForCausalLM
    return cls.from_pretrained(target, dtype=torch.float32).eval()


@functools.cache
def checkpoint(target: str) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(os.path.join(target, "model.safetensors")), json.load(
        open(os.path.join(target, "config.json"))
    )


def target_features(target, layout, token_ids):
    """The target's hidden states at every position, from transformers: final-norm (DeepSeek-V3's
    MTP reads them) or the last layer's output before the norm (MiMo's)."""
    ref = reference_model(target, layout)
    kept = {}
    hook = ref.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: kept.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        normed = ref.model(torch.tensor([token_ids])).last_hidden_state[0]
    hook.remove()
    return (kept["h"][0] if layout == "mimo" else normed), ref.model.embed_tokens.weight, ref.lm_head.weight


def reference_drafts(target, token_ids, k, forced=None, temperature=None):
    """Drafts and (with a temperature) q [k, vocab]: module d at depth d for d < L (its elements
    at positions 0..n-2 pair module d-1's output with token j+1+d), then the last module
    recursively at positions n-1, n, ... (its output, its draft). With `forced`, the drafted
    tokens are those (to follow a sampled run)."""
    w, cfg = checkpoint(target)
    layout = "mimo" if "model.mtp_layers.0.input_proj.weight" in w else "deepseek"
    num_modules = cfg["num_nextn_predict_layers"]
    feats_all, embed, lm_head = target_features(target, layout, token_ids)
    n = len(token_ids)
    seq = list(token_ids)
    drafts, qs = [], []

    def draft(m, head_in):
        head = w.get(f"model.layers.{NUM_LAYERS + m}.shared_head.head.weight", lm_head)
        logits = head_in @ head.T
        d = int(logits.argmax()) if forced is None else forced[len(drafts)]
        if temperature is not None:
            qs.append((logits / temperature).softmax(-1))
        drafts.append(d)
        seq.append(d)

    with torch.no_grad():
        feats = feats_all[: n - 1]
        for m in range(min(k, num_modules)):
            tokens = [seq[j + 1 + m] for j in range(n - 1)]
            out, head_in = mtp_module(w, layout, m, embed[tokens], feats)
            draft(m, head_in[-1])
            feats_m, tokens_m, feats = feats, tokens, out
        while len(drafts) < k:  # the last module again, one position further
            feats_m, tokens_m = torch.cat([feats_m, out[-1:]]), tokens_m + [drafts[-1]]
            out, head_in = mtp_module(w, layout, num_modules - 1, embed[tokens_m], feats_m)
            draft(num_modules - 1, head_in[-1])
    return drafts, (torch.stack(qs) if qs else None)


# --- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_drafts_and_q_match_reference(targets, name):
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(targets[name], dtype="float32", device="cpu", speculative=spec)
    proposer = engine.speculator.proposer
    assert len(proposer.layers) == LAYOUTS[name][2]
    if name == "deepseek1":  # its own head is kept; the embedding copy equals the target's: shared
        assert proposer.heads[0] is not proposer._target_head
        assert proposer.embed_tokens is engine.runner.model.embed_tokens
    engine.add_request("g", SPEC_PROMPTS[2], GREEDY)
    sampled = SamplingParams(max_tokens=24, temperature=0.7, seed=7, ignore_eos=True)
    engine.add_request("s", SPEC_PROMPTS[0], sampled)
    for _ in range(3):  # prefill + first drafts, then two verifications (incremental KV / features)
        engine.step()
        g, s = engine.scheduler.requests["g"], engine.scheduler.requests["s"]
        assert g.spec_token_ids == reference_drafts(targets[name], g.all_token_ids, 4)[0]
        _, q = reference_drafts(
            targets[name], s.all_token_ids, 4, forced=list(s.spec_token_ids), temperature=0.7
        )
        torch.testing.assert_close(engine.runner.draft_probs["s"], q, rtol=1e-4, atol=1e-5)
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("name,k", [("deepseek2", 5), ("mimo", 3)])
def test_greedy_output_equals_target(targets, name, k):
    base = LLMEngine(targets[name], dtype="float32", device="cpu")
    expected = run_staggered(base, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    spec = SpeculativeConfig(method="mtp", model=targets[name], num_speculative_tokens=k, adaptive=False)
    engine = LLMEngine(
        targets[name], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64
    )
    assert run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS) == expected
    assert engine.spec_stats.num_draft_tokens > 0
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("name", ["deepseek1", "mimo"])
def test_packed_catch_up_matches_the_torch_module_bfloat16(targets, name):
    """Where torch emulates bfloat16 products (no AVX512-BF16/AMX), a module's catch-up over more
    rows than the fused row path takes (a prompt's) runs its projection and block through the
    packed CPU kernel: the same features as torch's bfloat16 forward, to bfloat16 rounding."""
    from engine.model_runner import EXACT_ROWS, SeqChunk
    from kernels import cpu_kernels

    if not (cpu_kernels.available() and cpu_kernels.emulated_bf16()):
        pytest.skip("the packed catch-up is used only where torch emulates bfloat16 products")
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(targets[name], dtype="bfloat16", device="cpu", speculative=spec)
    proposer = engine.speculator.proposer
    assert proposer.layers[0].packed_matmuls
    prompt = [(7 * i) % 90 + 3 for i in range(EXACT_ROWS + 12)]
    engine.add_request("r", prompt, GREEDY)
    engine.step()  # prefill: the request's blocks exist
    r = engine.scheduler.requests["r"]
    n = len(prompt) - 2
    feats = torch.randn(n, proposer.feature_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    chunk = [SeqChunk([0] * n, 0, r.block_ids)]
    packed = proposer._forward(0, chunk, prompt[1 : n + 1], feats)
    proposer.layers[0].packed_matmuls = False
    plain = proposer._forward(0, chunk, prompt[1 : n + 1], feats)
    proposer.layers[0].packed_matmuls = True
    torch.testing.assert_close(packed.float(), plain.float(), rtol=3e-2, atol=3e-2)
    assert not torch.equal(packed, torch.zeros_like(packed))


def test_modules_catch_up_while_not_drafting(targets, monkeypatch):
    """A 40-token prompt prefilled 16 tokens a step, then 20 steps with speculation off (forced):
    the modules catch up over the buffered rows instead of holding more than the bound (set to
    the steady 16 rows here, below the lazy bound these 60 rows never reach); turned back on, the
    drafts equal the reference's over the whole context, so the KV they filled meanwhile is
    right."""
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=4, adaptive=True)
    engine = LLMEngine(
        targets["deepseek2"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=16
    )
    proposer = engine.speculator.proposer
    proposer.max_buffered_rows = proposer.steady_rows
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 0)
    prompt = [(7 * i + 3) % 97 for i in range(40)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    r = engine.scheduler.requests["r"]
    most = 0
    while r.num_output_tokens < 20:
        engine.step()
        st = proposer.states["r"]
        most = max(most, st.rows.shape[0])
        assert st.rows.shape[0] <= proposer.max_buffered_rows and all(d.rows.shape[0] <= 1 for d in st.deeper)
        assert_no_leaked_blocks(engine)
    assert most == proposer.max_buffered_rows and engine.spec_stats.num_draft_tokens == 0
    monkeypatch.setattr(engine.speculator, "choose_k", lambda request, step_index: 4)
    monkeypatch.setattr(engine.speculator, "best_cap", lambda num_decoding, requests, ks: max(ks))
    engine.step()
    assert r.spec_token_ids == reference_drafts(targets["deepseek2"], r.all_token_ids, 4)[0]


def test_missing_or_misshaped_key_is_refused(targets, tmp_path):
    """Every MTP tensor of each layout, dropped or given one extra row, is refused by name; so is
    a tensor under an MTP prefix that no module uses. (The target's own tensors stay as they are:
    the proposer reads its layers from the copy, the runner keeps the original target.)"""
    for name in ("deepseek1", "mimo"):
        src = targets[name]
        runner = ModelRunner(src, torch.device("cpu"), torch.float32, 128)
        MTPProposer(None, runner)  # the intact checkpoint loads
        weights = load_file(os.path.join(src, "model.safetensors"))
        prefix = "model.mtp_layers.0." if name == "mimo" else f"model.layers.{NUM_LAYERS}."
        keys = [k for k in weights if k.startswith(prefix)]
        assert len(keys) >= 13

        def load(d, runner=runner):
            other = copy.copy(runner)  # the same target, its MTP layers read from `d`
            other.model_dir = d
            return MTPProposer(None, other)

        optional = (prefix + "shared_head.head.weight", prefix + "embed_tokens.weight")
        assert_each_tensor_is_checked(
            load,
            weights,
            json.load(open(os.path.join(src, "config.json"))),
            tmp_path / name,
            keys=keys,
            optional=optional,
            extra=prefix + "unused_extra.weight",
        )


def test_model_must_be_the_target_and_have_mtp_layers(targets, tmp_path):
    with pytest.raises(DrafterMismatchError, match="target's own checkpoint"):
        LLMEngine(
            targets["deepseek1"],
            dtype="float32",
            device="cpu",
            speculative=SpeculativeConfig(method="mtp", model=targets["mimo"]),
        )
    plain = save_tiny_model(str(tmp_path / "plain"), "llama")
    with pytest.raises(DrafterMismatchError, match="num_nextn_predict_layers"):
        LLMEngine(plain, dtype="float32", device="cpu", speculative=SpeculativeConfig(method="mtp"))


@pytest.mark.slow  # make test-fast skips it
def test_sampled_distribution_matches_target(tmp_path):
    """Chi-square test of 3000 samples of (x1..x4) against the exact target distribution; fails
    when p < 1e-4 (false-failure probability 1e-4; fixed seed, so reproducible). Two modules, so
    drafts come from both depths and from the recursion."""
    target = add_mtp_layers(
        save_tiny_model(str(tmp_path / "t"), "llama", vocab_size=VOCAB), "deepseek", 2, seed=3, scale=3.0
    )
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, top_k=2, ignore_eos=True)
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    counts, stats = _sample_counts(target, spec, params, prompt)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p > 1e-4, f"p={p:.2e}"


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_handoff_equals_colocated(targets, params):
    """Two modules: the handoff carries both modules' buffered rows and KV."""
    from test_handoff import GREEDY as H_GREEDY
    from test_handoff import SAMPLED, assert_handoff_equals_colocated

    models = {"target": targets["deepseek2"], "mtp": None}
    h = assert_handoff_equals_colocated(models, "mtp", H_GREEDY if params == "greedy" else SAMPLED)
    assert h.drafter_kv is not None and h.drafter_kv.shape[0] == 2 and len(h.proposer_state.deeper) == 1
