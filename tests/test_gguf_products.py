"""The CPU row kernels' products over a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored
(kernels/csrc/gguf_products.cpp) and the engine serving them (`quantization="gguf"`): the products
equal their definition (per-group int16 activations times the dequantized weights) to float
rounding and the dequantized matrix's products to the activations' rounding; a row's result is
the same bits alone or among others, on the 512-bit and the 256-bit kernel; a model served so
matches transformers' logits, and speculation leaves its greedy output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_kernels

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.gguf_available(), reason="the CPU row kernels (AVX2/FMA/F16C) are unavailable")

Q = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def blocks(n: int, k: int, qtype: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights [n, k] quantized to `qtype`: (raw blocks, their dequantized float64 values)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, Q[qtype])
    return raw, dequantize(raw, Q[qtype]).astype(np.float64)


def activations_as_quantized(x: np.ndarray) -> np.ndarray:
    """What the kernel multiplies: each group of 32 of a row as int16 times its scale
    (s = max |x| / 32767, q = round(x / s), in float32)."""
    g = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    s = (np.abs(g).max(axis=2, keepdims=True) / np.float32(32767)).astype(np.float32)
    q = np.where(s > 0, np.rint(g / np.where(s > 0, s, 1)), 0)
    return (q.astype(np.float64) * s.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (70, 64), (130, 576), (64, 1536)])
def test_products_equal_their_definition_and_the_dequantized_matrix(qtype, n, k):
    raw, w = blocks(n, k, qtype)
    x = np.random.default_rng(1).standard_normal((9, k)).astype(np.float32)
    packed = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), qtype, k)
    y = cpu_kernels.packed_linear(torch.from_numpy(x), packed, n, None).numpy().astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    exact = activations_as_quantized(x) @ w.T
    assert np.max(np.abs(y - exact) / scale) < 2e-6  # float rounding of the group sums
    dequantized = x.astype(np.float64) @ w.T
    assert np.max(np.abs(y - dequantized) / scale) < 1e-4  # the activations' int16 rounding
    bias = torch.randn(n)
    with_bias = cpu_kernels.packed_linear(torch.from_numpy(x), packed, n, bias).numpy()
    assert np.array_equal(with_bias, (torch.from_numpy(y.astype(np.float32)) + bias).numpy())


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_is_the_same_bits_alone_in_a_batch_and_on_either_kernel(qtype):
    n, k = 200, 576
    raw, _ = blocks(n, k, qtype, seed=2)
    packed = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), qtype, k)
    x = torch.randn(13, k)
    x[:, 7] *= 300  # an outlier channel
    batch = cpu_kernels.packed_linear(x, packed, n, None)
    for m in (0, 5, 12):
        assert torch.equal(cpu_kernels.packed_linear(x[m : m + 1], packed, n, None)[0], batch[m])
    assert torch.equal(cpu_kernels.packed_linear(x[3:9], packed, n, None), batch[3:9])
    was = cpu_kernels.gguf_wide(False)
    try:
        assert torch.equal(cpu_kernels.packed_linear(x, packed, n, None), batch)
    finally:
        cpu_kernels.gguf_wide(was)


def test_bad_blocks_are_refused_with_the_reason():
    raw, _ = blocks(8, 64, "Q4_1")
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0"):
        cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), "Q5_K", 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), "Q4_1", 48)
    with pytest.raises(RuntimeError, match=r"uint8 \[N, 80\]"):
        cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), "Q4_1", 64 * 2)
    packed = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), "Q4_1", 64)
    with pytest.raises(RuntimeError, match=r"GGUF-packed weights \(pack_rows_gguf\) of 8 x 96"):
        cpu_kernels.packed_linear(torch.randn(1, 96), packed, 8, None)


# ---- the engine serving them ------------------------------------------------------------------


def rows_path_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` computed as the engine's decode steps compute them: through the row
    kernels, one token a step over a paged cache."""
    from engine.model_runner import SeqChunk, allocate_kv_cache, build_forward_batch
    from engine.models.llama import ROW_KERNEL
    from kernels import get_attention_backend

    backend = get_attention_backend(torch.device("cpu"), "torch")
    caches = allocate_kv_cache(model.cfg, 16, 8, torch.float32, torch.device("cpu"))
    out = []
    for pos in range(len(tokens)):
        batch = build_forward_batch([SeqChunk(tokens[pos : pos + 1], pos, list(range(16)))], 8, backend,
                                    torch.device("cpu"), row_exact="kernel")
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn_metadata, backend, tile_rows=ROW_KERNEL)
        out.append(model.compute_logits(hidden, tile_rows=ROW_KERNEL))
    return torch.cat(out)


@pytest.mark.parametrize("family,qtype", [("llama", "Q4_1"), ("llama", "Q4_0"), ("qwen2", "Q8_0")])
def test_a_model_served_from_its_blocks_matches_transformers(tmp_path, family, qtype):
    from test_gguf import TOKENS, transformers_logits, write_gguf

    from engine.models.loader import load_model

    path = write_gguf(tmp_path / f"{family}-{qtype}.gguf", family, qtype, hidden_size=64, intermediate_size=128)
    expected = transformers_logits(path, TOKENS)
    stored, _ = load_model(path, torch.float32, torch.device("cpu"), 256, quantization="gguf")
    layer = stored.layers[0].row_weights()
    assert all(layer[k].dtype == torch.uint8 for k in ("w_qkv", "w_o", "w_gate_up", "w_down"))  # the blocks, not bf16
    assert stored.packed_lm_head().dtype == torch.uint8
    got = rows_path_logits(stored, TOKENS)
    assert (got - expected).abs().max().item() < 2e-3 * expected.abs().max().item()
    dequantized, _ = load_model(path, torch.float32, torch.device("cpu"), 256)
    assert not torch.equal(rows_path_logits(dequantized, TOKENS), got)  # a different path did run


def test_speculation_leaves_greedy_output_unchanged_and_auto_picks_by_dtype(tmp_path):
    from test_gguf import write_gguf

    from engine import LLM, SamplingParams

    path = write_gguf(tmp_path / "m.gguf", "llama", "Q4_1", hidden_size=64, intermediate_size=128)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 77, 123, 9, 200, 41, 5, 77, 123], [18, 250, 66, 3, 18, 250]]
    plain = LLM(model=path, dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    assert plain.engine.runner.quantization == "gguf"
    spec = LLM(model=path, dtype="bfloat16", kv_cache_memory_bytes=1 << 22,
               speculative={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert LLM(model=path, dtype="float32").engine.runner.quantization == "none"


def test_quantization_gguf_where_it_cannot_run_says_why(tmp_path):
    from helpers import save_tiny_model

    from engine import LLM

    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=save_tiny_model(str(tmp_path / "m"), "llama"), quantization="int3")
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        LLM(model=str(tmp_path / "m"), quantization="gguf")
    from test_gguf import write_gguf

    f16 = write_gguf(tmp_path / "f16.gguf", "llama", "F16", hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match="stores none"):
        LLM(model=f16, quantization="gguf")
    assert LLM(model=f16, dtype="bfloat16").engine.runner.quantization == "none"
