"""The MTP training recipe (training/mtp.py): the module it trains computes the DeepSeek-V3
equations of the reference in test_mtp_native on the tensors it saves, a checkpoint it writes
loads in the engine (`method="mtp"`) with drafts equal to that reference and greedy output equal
to the target alone, and its loss trains."""

import json

import pytest
import torch
import transformers
from helpers import save_tiny_model
from safetensors.torch import load_file
from test_engine import run_staggered
from test_mtp_native import NUM_LAYERS, mtp_module, reference_drafts

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from training.mtp import MTPModule, mtp_loss_fn, save_mtp

VOCAB = 97


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_recipe")
    target = save_tiny_model(str(root / "target"), "llama")
    cfg = transformers.AutoConfig.from_pretrained(target)
    torch.manual_seed(3)
    module = MTPModule(cfg)
    with torch.no_grad():
        for p in module.parameters():  # norms start at 1: perturb everything
            p.add_(torch.randn_like(p) * 0.05)
    out = save_mtp(module, root / "target", root / "with_mtp")
    return {"target": target, "module": module, "dir": str(out)}


def test_module_is_the_reference_on_its_saved_tensors(recipe):
    w = load_file(f"{recipe['dir']}/model.safetensors")
    cfg = json.load(open(f"{recipe['dir']}/config.json"))
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == NUM_LAYERS
    p = f"model.layers.{NUM_LAYERS}."
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"} <= {
        k.removeprefix(p) for k in w if k.startswith(p)}
    g = torch.Generator().manual_seed(0)
    embeds, feats = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g)
    module = recipe["module"]
    assert w[p + "eh_proj.weight"].dtype == torch.float32  # (saved in the target's dtype, fp32 here)
    w = {k: v.float() for k, v in w.items()}
    with torch.no_grad():
        f = module(embeds[None], feats[None], torch.arange(7)[None])[0]
        ref_out, ref_head_in = mtp_module(w, "deepseek", 0, embeds, feats)
        torch.testing.assert_close(f, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(module.head_input(f), ref_head_in, atol=1e-5, rtol=1e-5)


def test_engine_loads_it_drafts_the_reference_and_stays_exact(recipe):
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
    engine = LLMEngine(recipe["dir"], dtype="float32", device="cpu", speculative=spec)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request("g", list(range(5, 25)), params)
    for _ in range(3):
        engine.step()
        r = engine.scheduler.requests["g"]
        assert r.spec_token_ids == reference_drafts(recipe["dir"], r.all_token_ids, 3)[0]
    base = LLMEngine(recipe["target"], dtype="float32", device="cpu")
    fresh = LLMEngine(recipe["dir"], dtype="float32", device="cpu", speculative=spec)
    prompts = [list(range(5, 25)), list(range(40, 49))]
    assert run_staggered(fresh, prompts, params, [0, 1]) == run_staggered(base, prompts, params, [0, 1])


def test_loss_trains(recipe):
    """A few optimizer steps on one batch close most of the gap between the loss and its floor
    (the target's entropy, step-weighted: the loss is a cross-entropy against its distribution)."""
    target = transformers.AutoModelForCausalLM.from_pretrained(recipe["target"], dtype=torch.float32).eval()
    module = MTPModule(target.config)
    batch = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    steps = 3
    with torch.no_grad():
        p = target(batch).logits.softmax(-1)
    n = batch.shape[1] - 2
    floor = sum(0.8**s * float(-(p * p.log()).sum(-1)[:, 1 + s : 1 + s + n - s].mean()) for s in range(steps))
    fn = mtp_loss_fn(module, target, unroll=steps)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    first, metrics = fn(batch)
    assert set(metrics) == {f"{m}{s}" for m in ("acc", "ce") for s in range(steps)}
    for _ in range(40):
        loss, _ = fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) - floor < 0.5 * (float(first.detach()) - floor)
