"""Medusa proposer on tiny random heads in the published Medusa-1 layout (FasterDecoding/Medusa:
config `medusa_num_heads`, `medusa_num_layers`; tensors `{i}.{j}.linear.*` and `{i}.{L}.weight`,
bare as the repo's training script saves them or under `medusa_head.`, as TensorRT-LLM and
vLLM's converter read them): drafts and draft probabilities equal a reference written here from
the paper's equations, a missing or mis-shaped key is refused by name, and greedy output equals
the target alone. (Our own layout: tests/test_eagle_mtp.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from helpers import assert_each_tensor_is_checked, assert_no_leaked_blocks, save_tiny_model
from safetensors.torch import load_file, save_file
from test_engine import run_staggered
from test_speculative import GREEDY, SPEC_ARRIVALS, SPEC_PROMPTS

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from engine.errors import DrafterMismatchError
from engine.model_runner import ModelRunner
from engine.spec_decode.proposers.medusa import MedusaProposer

H, VOCAB, NUM_HEADS = 64, 97, 3


def save_medusa(path: str, num_layers: int, prefix: str, filename: str, seed: int = 0) -> str:
    """Random Medusa-1 heads: config.json and the weights file the Medusa repo writes."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for i in range(NUM_HEADS):
        for j in range(num_layers):
            w[f"{prefix}{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g) * 0.15
            w[f"{prefix}{i}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.05
        w[f"{prefix}{i}.{num_layers}.weight"] = torch.randn(VOCAB, H, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    cfg = {
        "medusa_num_heads": NUM_HEADS,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "target",
        "hidden_size": H,
        "vocab_size": VOCAB,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if filename.endswith(".pt"):
        torch.save(w, os.path.join(path, filename))
    else:
        save_file(w, os.path.join(path, filename))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    target = save_tiny_model(str(root / "target"), "llama")
    heads = {  # two blocks a head, the whole model's names | one block, the training script's .pt
        "prefixed": save_medusa(str(root / "prefixed"), 2, "medusa_head.", "model.safetensors"),
        "bare": save_medusa(str(root / "bare"), 1, "", "medusa_lm_head.pt", seed=1),
    }
    return {"target": target, "heads": heads}


def load_heads(head_dir: str) -> tuple[dict[str, torch.Tensor], int, str]:
    cfg = json.load(open(os.path.join(head_dir, "config.json")))
    if os.path.isfile(os.path.join(head_dir, "model.safetensors")):
        return (
            load_file(os.path.join(head_dir, "model.safetensors")),
            cfg["medusa_num_layers"],
            "medusa_head.",
        )
    return torch.load(os.path.join(head_dir, "medusa_lm_head.pt")), cfg["medusa_num_layers"], ""


def reference_drafts(setup, which, token_ids, k, temperature=None):
    """Head i on the target's final-norm hidden state h_{n-2}: x <- x + SiLU(W_ij x + b_ij) for
    its blocks j, then its own LM head; its argmax drafts token n+i. With a temperature, q [k, V]."""
    w, num_layers, p = load_heads(setup["heads"][which])
    ref = transformers.AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        h = ref.model(torch.tensor([token_ids])).last_hidden_state[0, len(token_ids) - 2]
        drafts, qs = [], []
        for i in range(k):
            x = h
            for j in range(num_layers):
                x = x + torch.nn.functional.silu(
                    x @ w[f"{p}{i}.{j}.linear.weight"].T + w[f"{p}{i}.{j}.linear.bias"]
                )
            logits = x @ w[f"{p}{i}.{num_layers}.weight"].T
            drafts.append(int(logits.argmax()))
            if temperature is not None:
                qs.append((logits / temperature).softmax(-1))
    return drafts, (torch.stack(qs) if qs else None)


@pytest.mark.parametrize("which", ["prefixed", "bare"])
def test_drafts_and_q_match_reference(setup, which):
    spec = SpeculativeConfig(
        method="medusa", model=setup["heads"][which], num_speculative_tokens=NUM_HEADS, adaptive=False
    )
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    proposer = engine.speculator.proposer
    assert proposer.num_parameters == NUM_HEADS * (
        (H + 1) * H * (2 if which == "prefixed" else 1) + VOCAB * H
    )
    engine.add_request("g", SPEC_PROMPTS[2], GREEDY)
    engine.add_request(
        "s", SPEC_PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.7, seed=7, ignore_eos=True)
    )
    for _ in range(3):  # prefill + first drafts, then two verifications
        engine.step()
        g, s = engine.scheduler.requests["g"], engine.scheduler.requests["s"]
        assert g.spec_token_ids == reference_drafts(setup, which, g.all_token_ids, NUM_HEADS)[0]
        _, q = reference_drafts(setup, which, s.all_token_ids, NUM_HEADS, temperature=0.7)
        torch.testing.assert_close(engine.runner.draft_probs["s"], q, rtol=1e-4, atol=1e-5)
    assert_no_leaked_blocks(engine)


def test_greedy_output_equals_target(setup):
    expected = run_staggered(
        LLMEngine(setup["target"], dtype="float32", device="cpu"), SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS
    )
    spec = SpeculativeConfig(
        method="medusa",
        model=setup["heads"]["prefixed"],
        num_speculative_tokens=3,
        adaptive=False,
        draft_vocab_size=0,
    )
    engine = LLMEngine(
        setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64
    )
    assert run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS) == expected
    assert engine.spec_stats.num_draft_tokens > 0
    assert_no_leaked_blocks(engine)


def test_missing_or_misshaped_key_is_refused(setup, tmp_path):
    runner = ModelRunner(setup["target"], torch.device("cpu"), torch.float32, 128)
    src = setup["heads"]["prefixed"]
    MedusaProposer(src, runner)  # the intact checkpoint loads
    weights = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    assert_each_tensor_is_checked(lambda d: MedusaProposer(d, runner), weights, cfg, tmp_path)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "config.json").write_text(json.dumps({"hidden_size": H}))
    save_file(weights, str(no_config / "model.safetensors"))
    with pytest.raises(DrafterMismatchError, match="medusa_num_heads"):
        MedusaProposer(str(no_config), runner)
    (no_config / "config.json").write_text(json.dumps({**cfg, "vocab_size": 50}))
    with pytest.raises(DrafterMismatchError, match="vocab size 50"):
        MedusaProposer(str(no_config), runner)
