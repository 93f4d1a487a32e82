"""EAGLE and Medusa proposers in our layouts: drafts equal the reference heads (training.heads),
greedy output equals non-speculative output, sampled output follows the target distribution,
mismatched heads are refused, and EAGLE adds only its own layer (no copy of the embedding or LM
head). EAGLE-1's published layout (the EAGLE repo's head, as vLLM reads it): drafts and q equal a
reference from the paper's equations, and a missing or mis-shaped key is refused by name."""

import json
import os

import pytest
import torch
import transformers
from helpers import assert_each_tensor_is_checked, assert_no_leaked_blocks, save_tiny_heads, save_tiny_model
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

from engine import DrafterMismatchError, LLMEngine, SamplingParams, SpeculativeConfig
from training.heads import load_eagle_head, load_medusa_heads


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = save_tiny_model(str(root / "target"), "llama")
    eagle, medusa = save_tiny_heads(str(root), target)
    base = LLMEngine(target, dtype="float32", device="cpu")
    outs = run_staggered(base, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    return {"target": target, "eagle": eagle, "medusa": medusa, "baseline": [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))]}


def _reference_drafts(setup, method, prompt_and_output, k):
    """Greedy drafts of the reference heads, recomputing everything without a cache."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    ids = torch.tensor([prompt_and_output])
    with torch.no_grad():
        h = ref.model(ids).last_hidden_state[0]  # [n, H]
        n = ids.shape[1]
        if method == "medusa":
            heads = load_medusa_heads(setup["medusa"])
            feats = heads(h[n - 2 : n - 1])
            return [int(ref.lm_head(f[0]).argmax()) for f in feats[:k]]
        head = load_eagle_head(setup["eagle"])
        emb = ref.model.embed_tokens
        tokens = list(prompt_and_output)
        feats = h[: n - 1]  # h_0..h_{n-2}
        drafts = []
        for _ in range(k):
            m = feats.shape[0]
            out = head(emb(torch.tensor([tokens[1 : m + 1]])), feats.unsqueeze(0), torch.arange(1, m + 1).unsqueeze(0))
            f = out[0, -1]
            d = int(ref.lm_head(f).argmax())
            drafts.append(d)
            tokens.append(d)
            feats = torch.cat([feats, f.unsqueeze(0)])
        return drafts


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_drafts_match_reference_heads(setup, method):
    spec = SpeculativeConfig(method=method, model=setup[method], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    prompt = SPEC_PROMPTS[2]
    engine.add_request("r", prompt, GREEDY)
    engine.step()  # prefill, samples token 1, then proposes
    r = engine.scheduler.requests["r"]
    drafts = list(r.spec_token_ids)
    assert drafts == _reference_drafts(setup, method, r.all_token_ids, 4)
    engine.step()  # verify; then drafts again from the new position (incremental KV / features)
    r = engine.scheduler.requests["r"]
    assert r.spec_token_ids == _reference_drafts(setup, method, r.all_token_ids, 4)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("k,adaptive", [(1, False), (3, False), (4, True), (8, False)])
def test_greedy_output_equals_non_speculative(setup, method, k, adaptive):
    spec = SpeculativeConfig(method=method, model=setup[method], num_speculative_tokens=k, adaptive=adaptive)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=64)
    outs = run_staggered(engine, SPEC_PROMPTS, GREEDY, SPEC_ARRIVALS)
    assert [outs[f"r{i}"] for i in range(len(SPEC_PROMPTS))] == setup["baseline"]
    if not adaptive:
        assert engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_greedy_equivalence_under_preemption(setup, method):
    spec = SpeculativeConfig(method=method, model=setup[method], num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", block_size=4, speculative=spec,
                       kv_cache_memory_bytes=18 * 4 * (2 * 2 * 2 * 16 * 4 + 2 * 2 * 16 * 4), max_model_len=60)
    prompts = [p[:30] for p in SPEC_PROMPTS]
    outs = run_staggered(engine, prompts, GREEDY, SPEC_ARRIVALS)
    assert engine.scheduler.num_preemptions > 0
    expected = run_staggered(LLMEngine(setup["target"], dtype="float32", device="cpu"), prompts, GREEDY, SPEC_ARRIVALS)
    assert outs == expected
    assert_no_leaked_blocks(engine)


@pytest.fixture(scope="module")
def small_vocab_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads3")
    target = save_tiny_model(str(root / "t"), "llama", vocab_size=VOCAB)
    # heads built for vocab 3: patch the tiny config's vocab through the TINY defaults
    import helpers

    old = helpers.TINY["vocab_size"]
    helpers.TINY["vocab_size"] = VOCAB
    try:
        eagle, medusa = save_tiny_heads(str(root), target, seed=3, scale=3.0)
    finally:
        helpers.TINY["vocab_size"] = old
    return target, {"eagle": eagle, "medusa": medusa}


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.slow  # make test-fast skips it
def test_sampled_distribution_matches_target(small_vocab_heads, method):
    """Chi-square test of 3000 samples of (x1..x4) against the exact target distribution; fails
    when p < 1e-4 (false-failure probability 1e-4; fixed seed, so reproducible)."""
    target, heads = small_vocab_heads
    prompt = [0, 1, 2, 1, 0, 1, 2, 1, 0]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, top_k=2, ignore_eos=True)
    spec = SpeculativeConfig(method=method, model=heads[method], num_speculative_tokens=3, adaptive=False)
    counts, stats = _sample_counts(target, spec, params, prompt)
    assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p = _chi_square_p_value(counts, _exact_distribution(target, prompt, params), NUM_SAMPLES)
    assert p > 1e-4, f"p={p:.2e}"


def test_mismatched_heads_are_refused(setup, tmp_path):
    other = save_tiny_model(str(tmp_path / "other"), "llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(DrafterMismatchError, match=r"hidden size 64 vs the target's 32"):
        LLMEngine(other, dtype="float32", device="cpu",
                  speculative=SpeculativeConfig(method="eagle", model=setup["eagle"]))
    renamed = tmp_path / "medusa_other"
    renamed.mkdir()
    cfg = json.load(open(os.path.join(setup["medusa"], "config.json")))
    cfg["target"] = "some-other-model"
    (renamed / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(setup["medusa"], "model.safetensors"), renamed / "model.safetensors")
    with pytest.raises(DrafterMismatchError, match="some-other-model"):
        LLMEngine(setup["target"], dtype="float32", device="cpu",
                  speculative=SpeculativeConfig(method="medusa", model=str(renamed)))
    small_vocab = save_tiny_model(str(tmp_path / "v50"), "llama", vocab_size=50)
    with pytest.raises(DrafterMismatchError, match="vocab_size 50"):
        LLMEngine(setup["target"], dtype="float32", device="cpu",
                  speculative=SpeculativeConfig(method="draft", model=small_vocab))


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def test_eagle_adds_only_its_layer_and_kv(setup):
    plain = LLMEngine(setup["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
    spec = SpeculativeConfig(method="eagle", model=setup["eagle"], num_speculative_tokens=4)
    eng = LLMEngine(setup["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20, speculative=spec)
    proposer = eng.speculator.proposer
    assert proposer.embed_tokens.weight.data_ptr() == eng.runner.model.embed_tokens.weight.data_ptr()
    assert proposer.head.weight.data_ptr() == eng.runner.model.lm_head.weight.data_ptr()

    def all_weights(e):
        ts = list(e.runner.model.parameters())
        if e.speculator is not None:
            ts += [p for m in e.speculator.proposer.modules() for p in m.parameters()]
        return ts

    # the caches' own bytes: CPU caches are views of one buffer on huge pages, whose alignment
    # slack (up to 2 MiB of address space) is never touched
    def cache_bytes(caches):
        return sum(t.numel() * t.element_size() for kv in caches for t in kv)

    head_bytes = proposer.num_parameters * 4
    head_kv = cache_bytes(proposer.kv_caches)
    # same KV budget is split between target and head, so compare weights and head KV separately
    weights_plain = _storage_bytes(plain.runner.model.parameters())
    weights_spec = _storage_bytes(list(eng.runner.model.parameters()) + [p for m in proposer.modules() for p in m.parameters()])
    assert weights_spec - weights_plain == head_bytes
    assert head_kv == eng.num_blocks * eng.block_manager.block_size * proposer.kv_bytes_per_token()
    total = _storage_bytes(all_weights(eng)) + cache_bytes(eng.runner.kv_caches) + head_kv
    assert total <= weights_plain + head_bytes + (1 << 20) + 4096


# --- EAGLE-1's published layout (the EAGLE repo's head, as vLLM reads it) ------------------------
def save_published_eagle(path: str, target: str, pickled: bool = False, seed: int = 0, drop: str = "") -> str:
    """A random EAGLE-1 head as the EAGLE repo saves it: a one-layer Llama config, `fc.weight` and
    `fc.bias`, `layers.0.*` without input_layernorm, and a copy of the target's embedding (less
    the tensor `drop`)."""
    from test_mtp_native import HEADS, INTER, KV_HEADS, _random, decoder_layer_tensors

    rnd, norm_w = _random(torch.Generator().manual_seed(seed), 1.0)
    layer = decoder_layer_tensors(rnd, norm_w, "layers.0.", bias=False)
    del layer["layers.0.input_layernorm.weight"]
    embed = load_file(os.path.join(target, "model.safetensors"))["model.embed_tokens.weight"]
    w = {"fc.weight": rnd(64, 128, std=0.1), "fc.bias": rnd(64, std=0.02), "embed_tokens.weight": embed, **layer}
    w.pop(drop, None)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
           "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "vocab_size": embed.shape[0], "torch_dtype": "float32"}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if pickled:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    return path


def _published_eagle_drafts(setup, head_dir, token_ids, k, forced=None, temperature=None):
    """The EAGLE paper's drafting, no cache: element j = (h_j, t_{j+1}) at position j, x =
    fc(cat(embed, h)), the layer without its input norm, logits = the target's lm_head(output);
    the output and the drafted token form the next element."""
    from test_mtp_native import decoder_layer

    w = load_file(os.path.join(head_dir, "model.safetensors")) if os.path.isfile(
        os.path.join(head_dir, "model.safetensors")) else torch.load(os.path.join(head_dir, "pytorch_model.bin"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        feats = ref.model(torch.tensor([token_ids])).last_hidden_state[0, : len(token_ids) - 1]
        tokens, drafts, qs = list(token_ids[1:]), [], []
        for step in range(k):
            x = torch.cat([ref.model.embed_tokens.weight[torch.tensor(tokens)], feats], -1) @ w["fc.weight"].T + w["fc.bias"]
            out = decoder_layer(w, "layers.0.", x, torch.arange(x.shape[0]), input_norm=False)[-1]
            logits = ref.lm_head(out)
            d = int(logits.argmax()) if forced is None else forced[step]
            if temperature is not None:
                qs.append((logits / temperature).softmax(-1))
            drafts.append(d)
            tokens.append(d)
            feats = torch.cat([feats, out[None]])
    return drafts, (torch.stack(qs) if qs else None)


@pytest.mark.parametrize("pickled", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_published_eagle_drafts_and_q_match_reference(setup, tmp_path, pickled):
    head = save_published_eagle(str(tmp_path / "eagle"), setup["target"], pickled=pickled)
    spec = SpeculativeConfig(method="eagle", model=head, num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(setup["target"], dtype="float32", device="cpu", speculative=spec)
    assert engine.speculator.proposer.embed_tokens is engine.runner.model.embed_tokens  # the copy is not loaded
    engine.add_request("g", SPEC_PROMPTS[2], GREEDY)
    engine.add_request("s", SPEC_PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.7, seed=7, ignore_eos=True))
    for _ in range(3):
        engine.step()
        g, s = engine.scheduler.requests["g"], engine.scheduler.requests["s"]
        assert g.spec_token_ids == _published_eagle_drafts(setup, head, g.all_token_ids, 4)[0]
        _, q = _published_eagle_drafts(setup, head, s.all_token_ids, 4, forced=list(s.spec_token_ids), temperature=0.7)
        torch.testing.assert_close(engine.runner.draft_probs["s"], q, rtol=1e-4, atol=1e-5)
    assert_no_leaked_blocks(engine)


def test_published_eagle_missing_or_misshaped_key_is_refused(setup, tmp_path):
    from engine.model_runner import ModelRunner
    from engine.spec_decode.proposers.eagle import EagleProposer

    src = save_published_eagle(str(tmp_path / "src"), setup["target"])
    runner = ModelRunner(setup["target"], torch.device("cpu"), torch.float32, 128)
    weights = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    # optional: fc.bias, the embedding copy; without fc.weight it is not the published layout
    assert_each_tensor_is_checked(lambda d: EagleProposer(d, runner), weights, cfg, tmp_path / "keys",
                                  optional=("fc.bias", "embed_tokens.weight", "fc.weight"),
                                  extra="layers.0.input_layernorm.weight")  # EAGLE-1's layer has none
    with pytest.raises(DrafterMismatchError, match="fc.weight"):
        EagleProposer(save_published_eagle(str(tmp_path / "no_fc"), setup["target"], drop="fc.weight"), runner)
