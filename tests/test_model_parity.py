"""Our decoder's logits equal transformers' (fp32), for prefill and for decode over the paged cache."""

import pytest
import torch
import transformers
from helpers import save_tiny_model

from engine.model_runner import SeqChunk, allocate_kv_cache, build_forward_batch
from engine.models.loader import load_model
from kernels import get_attention_backend

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _our_logits_paged(model, tokens, block_size, chunks, block_ids):
    """Run `tokens` through our model in the given chunk sizes over a paged cache."""
    backend = get_attention_backend(torch.device("cpu"), "torch")
    caches = allocate_kv_cache(model.cfg, 32, block_size, torch.float32, torch.device("cpu"))
    out, pos = [], 0
    for n in chunks:
        batch = build_forward_batch([SeqChunk(tokens[pos : pos + n], pos, block_ids)], block_size, backend, torch.device("cpu"))
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn_metadata, backend)
        out.append(model.compute_logits(hidden))
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    path = save_tiny_model(str(tmp_path / family), family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_model(path, torch.float32, torch.device("cpu"), 512)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (29,), generator=g).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]
    block_ids = [5, 2, 9, 0, 7, 3, 11, 1]  # non-contiguous on purpose
    prefill = _our_logits_paged(ours, tokens, 4, [29], block_ids)
    assert (prefill - expected).abs().max().item() < 1e-4
    # chunked prefill then one token at a time (decode over the paged cache)
    mixed = _our_logits_paged(ours, tokens, 4, [7, 10] + [1] * 12, block_ids)
    assert (mixed - expected).abs().max().item() < 1e-4


def test_llama3_rope_scaling_and_untied_head(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    path = save_tiny_model(str(tmp_path / "l3"), "llama", rope_parameters=rope, tie_word_embeddings=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_model(path, torch.float32, torch.device("cpu"), 512)
    tokens = list(range(3, 90))
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]
    got = _our_logits_paged(ours, tokens, 16, [40, 47], list(range(8)))
    assert (got - expected).abs().max().item() < 1e-4


def test_unsupported_architecture_is_refused(tmp_path):
    from engine import UnsupportedModelError

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64)


def test_checkpoint_without_weights_is_refused(tmp_path):
    from engine import CheckpointError

    save_tiny_model(str(tmp_path), "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, torch.device("cpu"), 64)
