"""The EAGLE-3 training recipe (training/eagle3.py) trains the head the engine runs: a head saved
by the recipe loads in the engine's `eagle3` proposer, and every step of its training-time-test
unroll equals the reference forward of autoregressive drafting (tests/test_eagle3.py, which the
engine's drafts are checked against) on the same tokens, so what training optimizes is what
inference drafts."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import save_tiny_model
from test_eagle3 import EPS, HEAD_DIM, HEADS, INTER, KV_HEADS, NUM_LAYERS, THETA, H, reference_drafts
from test_engine import run_staggered

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from training.eagle3 import Eagle3Config, Eagle3Head, draft_vocabulary, eagle3_loss_fn, save_eagle3

VOCAB, STEPS = 97, 3


@pytest.fixture(scope="module")
def trained_layout(tmp_path_factory):
    return make_layout(tmp_path_factory, (2, 3, 4))


def make_layout(tmp_path_factory, aux_layer_ids):
    """A tiny target and a random head of the recipe, saved in the published layout."""
    root = tmp_path_factory.mktemp("eagle3_train")
    target = save_tiny_model(str(root / "target"), "llama", num_hidden_layers=NUM_LAYERS)
    ranked = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)).tolist()
    token_ids = draft_vocabulary(ranked, 64)
    assert token_ids.tolist() == sorted(ranked[:64])
    cfg = Eagle3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=INTER, vocab_size=VOCAB, draft_vocab_size=64, aux_layer_ids=aux_layer_ids,
        rms_norm_eps=EPS, rope_theta=THETA,
    )
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    with torch.no_grad():  # norms away from 1 so that each one's place is checked
        for p in head.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    save_eagle3(head, token_ids, root / "head", dtype=torch.float32)
    return {"target": target, "head": head.eval(), "dir": str(root / "head"), "token_ids": token_ids,
            "heads": {"trained": str(root / "head")}, "boundaries": {"trained": aux_layer_ids}}


@pytest.mark.parametrize("aux_layer_ids", [(2, 3, 4), (2, 4, NUM_LAYERS)], ids=["default", "last-layer-output"])
def test_unroll_equals_autoregressive_drafting(tmp_path_factory, aux_layer_ids):
    """Boundary L (the last layer's output) is taken before the final norm, as the engine does."""
    trained_layout = make_layout(tmp_path_factory, aux_layer_ids)
    tokens = torch.randint(2, VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    ref = transformers.AutoModelForCausalLM.from_pretrained(trained_layout["target"], dtype=torch.float32).eval()
    fn = eagle3_loss_fn(trained_layout["head"], ref, trained_layout["token_ids"], STEPS)  # hooks the last layer
    captured = {}
    head = trained_layout["head"]
    orig = head.unroll_features
    head.unroll_features = lambda aux, embeds, steps: captured.setdefault("feats", orig(aux, embeds, steps))
    try:
        with torch.no_grad():
            fn(tokens)
    finally:
        head.unroll_features = orig
    with torch.no_grad():
        logits = [head.lm_head(head.norm(f)) for f in captured["feats"]]
    ids = trained_layout["token_ids"]
    for j in (0, 4, 9):  # element j: feature of position j, token j + 1
        seq = tokens[0].tolist()
        _, q = reference_drafts(trained_layout, "trained", seq[: j + 2], STEPS, forced=seq[j + 2 : j + 2 + STEPS],
                                temperature=1.0)
        for s in range(STEPS):
            mine = torch.zeros(VOCAB).index_copy_(0, ids, logits[s][0, j].softmax(-1))
            torch.testing.assert_close(mine, q[s], rtol=1e-4, atol=1e-6, msg=f"index {j} step {s}")


def test_engine_loads_the_recipe_layout_and_stays_exact(trained_layout):
    base = LLMEngine(trained_layout["target"], dtype="float32", device="cpu")
    spec = SpeculativeConfig(method="eagle3", model=trained_layout["dir"], num_speculative_tokens=3, adaptive=False)
    eng = LLMEngine(trained_layout["target"], dtype="float32", device="cpu", speculative=spec)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 25)), list(range(40, 49))]
    assert run_staggered(eng, prompts, params, [0, 1]) == run_staggered(base, prompts, params, [0, 1])


def test_loss_trains(trained_layout):
    """A few optimizer steps on one batch close most of the gap between the loss and its floor
    (the target's entropy over the draft vocabulary, step-weighted: the loss is a cross-entropy)."""
    target = transformers.AutoModelForCausalLM.from_pretrained(trained_layout["target"], dtype=torch.float32).eval()
    head = Eagle3Head(trained_layout["head"].config)
    head.load_state_dict(trained_layout["head"].state_dict())
    ids = trained_layout["token_ids"]
    batch = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        p = target(batch).logits[..., ids].softmax(-1)
    n = batch.shape[1] - STEPS
    floor = sum(0.8**s * float(-(p * p.log()).sum(-1)[:, s + 1 : s + 1 + n].mean()) for s in range(STEPS))
    fn = eagle3_loss_fn(head, target, ids, STEPS)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    first, metrics = fn(batch)
    assert set(metrics) == {f"{m}{s}" for m in ("acc", "ce") for s in range(STEPS)}
    for _ in range(30):
        loss, _ = fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) - floor < 0.5 * (float(first.detach()) - floor)
