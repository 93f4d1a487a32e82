"""bench/eval_models.py's `eagle3` and `mtp` methods: their KV-cached rollouts equal an uncached
recomputation from the saved tensors (the papers' equations with tests/helpers' reference math,
every element of the sequence recomputed for each start and depth), greedy acceptance counts
forced-correct / forced-incorrect drafts exactly, and the methods load and run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import TINY, ref_attention, ref_rms, ref_rope, save_tiny_model, torch_threads
from safetensors.torch import load_file
from torch.nn import functional as F

from bench import eval_models as ev
from training.eagle3 import Eagle3Config, Eagle3Head, draft_vocabulary, save_eagle3
from training.mtp import MTPModule, save_mtp

VOCAB, H, HEADS, KV, HD, L = TINY["vocab_size"], TINY["hidden_size"], 4, 2, 16, 3
AUX = (0, 2, L)  # L: the last layer's output before the final norm
DEPTH = 3


def perturbed(module: torch.nn.Module, scale: float) -> None:
    """Norm weights away from 1 (so each norm's place matters) and matrices sharpened."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn_like(p))
            else:
                p.mul_(1.5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread (two threads spin against any other CPU load)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_models")
    target_dir = save_tiny_model(str(root / "target"), "llama", num_hidden_layers=L)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ranked = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)).tolist()
    token_ids = draft_vocabulary(ranked, 64)
    cfg = Eagle3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                       intermediate_size=TINY["intermediate_size"], vocab_size=VOCAB, draft_vocab_size=64,
                       aux_layer_ids=AUX, rms_norm_eps=TINY["rms_norm_eps"])
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    perturbed(head, 0.2)
    save_eagle3(head, token_ids, root / "eagle3", dtype=torch.float32)
    torch.manual_seed(1)
    module = MTPModule(target.config)
    perturbed(module, 0.2)
    save_mtp(module, Path(target_dir), root / "target-mtp")
    p = f"model.layers.{L}."
    mtp_w = {k.removeprefix(p): v for k, v in load_file(str(root / "target-mtp" / "model.safetensors")).items()
             if k.startswith(p)}
    models = {"target": target, "eagle3": ev.load_eagle3(root / "eagle3", target, torch.float32),
              "mtp": ev.load_mtp(root / "target-mtp", target, torch.float32)}
    return {"root": root, "models": models, "token_ids": token_ids,
            "weights": {"eagle3": load_file(str(root / "eagle3" / "model.safetensors")), "mtp": mtp_w}}


# --- the uncached reference ----------------------------------------------------------------------
def ref_block(w: dict, p: str, attn_in: torch.Tensor, resid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A Llama decoder layer from raw tensors: causal attention over all elements reads `attn_in`,
    the residual stream starts at `resid`."""
    m = attn_in.shape[0]
    q, k, v = (attn_in @ w[f"{p}self_attn.{x}_proj.weight"].T for x in "qkv")
    q, k, v = q.view(m, HEADS, HD), k.view(m, KV, HD), v.view(m, KV, HD)
    r = resid + ref_attention(ref_rope(q, pos), ref_rope(k, pos), v) @ w[f"{p}self_attn.o_proj.weight"].T
    x = ref_rms(r, w[f"{p}post_attention_layernorm.weight"])
    mlp = F.silu(x @ w[f"{p}mlp.gate_proj.weight"].T) * (x @ w[f"{p}mlp.up_proj.weight"].T)
    return r + mlp @ w[f"{p}mlp.down_proj.weight"].T


def eagle3_elements(w, e, g, pos):
    """EAGLE-3: attention on [input_layernorm(e), hidden_norm(g)], residual from g."""
    x = torch.cat([ref_rms(e, w["midlayer.input_layernorm.weight"]), ref_rms(g, w["midlayer.hidden_norm.weight"])], -1)
    return ref_block(w, "midlayer.", x, g, pos)


def mtp_elements(w, e, h, pos):
    """DeepSeek-V3 MTP: x = eh_proj([enorm(e), hnorm(h)]), then a whole decoder layer."""
    x = torch.cat([ref_rms(e, w["enorm.weight"]), ref_rms(h, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
    return ref_block(w, "", ref_rms(x, w["input_layernorm.weight"]), x, pos)


def ref_rollout(elements, logits_of, emb, feats, n: int, depth: int) -> list[torch.Tensor]:
    """Start n: committed elements (feats[t-1], token t) at position t-1 for t = 1..n-1, then the
    chain's own (output feature, token) elements; every depth recomputes all of them."""
    es, fs, ps = [emb[t] for t in range(1, n)], [feats[t - 1] for t in range(1, n)], list(range(n - 1))
    out = []
    for i in range(depth):
        f = elements(torch.stack(es), torch.stack(fs), torch.tensor(ps))[-1]
        out.append(logits_of(f))
        es.append(emb[n + i])
        fs.append(f)
        ps.append(n + i - 1)
    return out


def reference(setup, method: str, seq: list[int], starts, weights=None, post_norm_aux: bool = False):
    target, ids = setup["models"]["target"], torch.tensor([seq])
    w = weights or setup["weights"][method]
    with torch.no_grad():
        emb = target.get_input_embeddings()(ids)[0]
        if method == "mtp":
            feats = target.model(input_ids=ids).last_hidden_state[0]  # final-norm features
            lm = target.lm_head.weight

            def logits_of(f):
                return ref_rms(f, w["shared_head.norm.weight"]) @ lm.T

            elements = mtp_elements
        else:
            hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
            no_norm = transformers.AutoModelForCausalLM.from_pretrained(
                str(setup["root"] / "target"), dtype=torch.float32).eval()
            no_norm.model.norm = torch.nn.Identity()
            last = hs[L] if post_norm_aux else no_norm.model(input_ids=ids).last_hidden_state
            feats = torch.cat([last if b == L else hs[b] for b in AUX], -1)[0] @ w["fc.weight"].T

            def logits_of(f):
                full = torch.full((VOCAB,), float("-inf"))
                full[setup["token_ids"]] = ref_rms(f, w["norm.weight"]) @ w["lm_head.weight"].T
                return full

            elements = eagle3_elements
        return {n: ref_rollout(lambda e, f, p: elements(w, e, f, p), logits_of, emb, feats, n, DEPTH) for n in starts}


def random_seq(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_rollout_equals_uncached_reference(setup, method):
    seq, prompt_len, starts = random_seq(20, 5), 5, (6, 11, 17)
    res = ev.draft_distributions(method, setup["models"], seq, prompt_len, greedy=False)
    assert sorted(res) == list(range(prompt_len + 1, len(seq)))
    assert [len(res[n]) for n in starts] == [min(ev.MAX_K, len(seq) - n) for n in starts]
    ref = reference(setup, method, seq, starts)
    for n in starts:
        for d in range(DEPTH):
            torch.testing.assert_close(res[n][d], ref[n][d], atol=1e-4, rtol=1e-4, msg=f"start {n} depth {d + 1}")
    # negative controls: the comparison sees a 10% change of one weight, and (EAGLE-3) the feature
    # after the final norm in place of the last layer's output
    key = "hnorm.weight" if method == "mtp" else "midlayer.hidden_norm.weight"
    bad = dict(setup["weights"][method], **{key: setup["weights"][method][key] * 1.1})
    wrong = [reference(setup, method, seq, starts, weights=bad)]
    if method == "eagle3":
        wrong.append(reference(setup, method, seq, starts, post_norm_aux=True))
    for other in wrong:
        assert not all(torch.allclose(res[n][0], other[n][0], atol=1e-3, rtol=1e-3) for n in starts)
    if method == "eagle3":  # the agreement metric (the head's own TTT unroll, step 0) is depth 1
        tf = setup["models"]["eagle3"].teacher_forced(setup["models"]["target"], torch.tensor([seq]))[0]
        for n in starts:
            torch.testing.assert_close(tf[n - 2], res[n][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_greedy_acceptance_counts_forced_drafts(setup, method):
    """The continuation after start n is made the head's own greedy chain for 4 tokens and then a
    different token: exactly 4 drafts match, and the greedy rollout stops after the 5th draft."""
    models, seq, prompt_len, n = setup["models"], random_seq(18, 7), 7, 9
    for i in range(5):  # depth i+1 depends only on seq[:n+i]: fix the continuation token by token
        top = int(ev.draft_distributions(method, models, seq, prompt_len, greedy=False)[n][i].argmax())
        seq[n + i] = top if i < 4 else (top + 1) % VOCAB
    g = ev.draft_distributions(method, models, seq, prompt_len, greedy=True)
    full = ev.draft_distributions(method, models, seq, prompt_len, greedy=False)
    assert ev.greedy_matches(g, seq)[n] == ev.greedy_matches(full, seq)[n] == 4
    assert len(g[n]) == 5 and len(full[n]) == ev.MAX_K
    for a, b in zip(g[n], full[n], strict=False):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    seq[n + 1] = (seq[n + 1] + 1) % VOCAB  # now the second draft is wrong
    g = ev.draft_distributions(method, models, seq, prompt_len, greedy=True)
    assert ev.greedy_matches(g, seq)[n] == 1 and len(g[n]) == 2
    # replay: two matches everywhere -> 3 tokens per step (k >= 2), 2 with k = 1
    match = {p: 2 for p in range(12)}
    assert [ev.replay_greedy(match, 0, 12, k) for k in (1, 2, 8)] == [2.0, 3.0, 3.0]


def test_end_to_end_rows(setup):
    models = dict(setup["models"])
    dv = torch.zeros(VOCAB, dtype=torch.bool)
    dv[:80] = True
    models["draft_vocab"] = dv
    cfg = ev.EvalConfig(prompt_len=6, gen_len=10, temp_start_stride=2)
    prompts = [random_seq(6, 11), random_seq(6, 12)]
    acc = ev.acceptance(models, ["eagle3", "mtp"], prompts, cfg)
    assert set(acc["greedy"]) == set(acc["T0.7"]) == {"eagle3", "mtp", "mtp@dv80"}
    for per_method in acc.values():
        for per_k in per_method.values():
            assert all(1.0 <= per_k[k] <= k + 1 for k in per_k)
    agr = ev.agreement(models, torch.tensor([random_seq(16, s) for s in range(3)]))
    assert {"eagle3", "mtp", "mtp@dv"} <= set(agr) and all(0.0 <= agr[k] <= 1.0 for k in ("eagle3", "mtp"))
    table = ev.markdown(json.loads(json.dumps({"perplexity": {}, "agreement": agr, "acceptance": acc})))
    assert "| eagle3-head (teacher-forced" in table and "| mtp module (teacher-forced" in table
    assert "| eagle3 | greedy |" in table and "| mtp@dv80 | T0.7 |" in table


def test_load_models_locates_and_checks(setup):
    root = setup["root"]
    found = ev.load_models(root, eagle3_dir=str(root / "eagle3"), mtp_dir=str(root / "target-mtp"))
    assert {"eagle3", "mtp"} <= set(found)
    assert not {"eagle3", "mtp"} & set(ev.load_models(root))  # no eagle3-head, target without MTP layers
    other_dir = save_tiny_model(str(root / "other"), "llama", seed=1, num_hidden_layers=L)
    other = transformers.AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="differs from the evaluated target"):
        ev.load_mtp(root / "target-mtp", other, torch.float32)
