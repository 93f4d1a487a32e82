"""The CPU row kernels' products over a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored
(kernels/csrc/gguf_products.cpp) and the engine serving them (`quantization="gguf"`): the products
equal their definition (per-group int16 activations times the dequantized weights) to float
rounding and the dequantized matrix's products to the activations' rounding; a row's result is
the same bits alone or among others, on the 512-bit and the 256-bit kernel; a model served so
matches transformers' logits, and speculation leaves its greedy output unchanged. The same for
Q4 blocks marked for int8 activations (`quantization="gguf_a8"`)."""

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


def activations_as_quantized(x: np.ndarray, qmax: int = 32767, group: int = 32) -> np.ndarray:
    """What the kernel multiplies: each group of 32 of a row as int16 (qmax 32767; int8: 127 per
    group of 16) times its scale (s = max |x| / qmax, q = round(x / s), in float32)."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float32)
    s = (np.abs(g).max(axis=2, keepdims=True) / np.float32(qmax)).astype(np.float32)
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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", [(1, 32), (70, 64), (130, 576), (64, 1536)])
def test_int8_activation_products_equal_their_definition(qtype, n, k):
    """Q4 blocks marked for int8 activations: the products of the activations quantized to int8
    per half group of 16 and the dequantized weights, to float rounding; a row the same bits alone or
    among others (rows 1-13: every count of rows a pass takes); Q8_0 blocks are left as they are."""
    raw, w = blocks(n, k, qtype, seed=3)
    x = np.random.default_rng(4).standard_normal((13, k)).astype(np.float32)
    x[:, 5] *= 40  # an outlier channel: its group's other activations lose precision in int8
    blocks_u8 = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), qtype, k)
    packed = cpu_kernels.gguf_int8_activations(blocks_u8)
    assert packed.dtype == torch.int8 and packed.data_ptr() == blocks_u8.data_ptr()  # a view: no copy
    y = cpu_kernels.packed_linear(torch.from_numpy(x), packed, n, None)
    y64 = y.numpy().astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.max(np.abs(y64 - activations_as_quantized(x, 127, 16) @ w.T) / scale) < 2e-6
    # off the dequantized matrix's products by int8's rounding: at most half a step of each half
    # group's scale (max |x| / 127 over 16) on each input, and visibly more than int16's
    half_step = np.repeat(np.abs(x.reshape(13, -1, 16)).max(axis=2) / 127 / 2, 16, axis=1)
    error = np.abs(y64 - x.astype(np.float64) @ w.T)
    assert np.all(error <= half_step @ np.abs(w).T * (1 + 1e-5) + 2e-6 * scale)
    int16 = cpu_kernels.packed_linear(torch.from_numpy(x), blocks_u8, n, None).numpy().astype(np.float64)
    assert np.max(np.abs(y64 - int16) / scale) > 1e-4
    for m in range(1, 14):
        assert torch.equal(cpu_kernels.packed_linear(torch.from_numpy(x[:m]), packed, n, None), y[:m])
    raw8, _ = blocks(n, k, "Q8_0")
    q8 = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw8), "Q8_0", k)
    assert cpu_kernels.gguf_int8_activations(q8) is q8


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


A8_LOGITS_TOLERANCE = 5e-2  # of the largest logit: int8 activations round to 0.4% of a 16-input group's largest


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
    if qtype.startswith("Q4"):  # int8 activations: the Q4 blocks marked, logits within their rounding
        a8, _ = load_model(path, torch.float32, torch.device("cpu"), 256, quantization="gguf_a8")
        assert a8.layers[0].row_weights()["w_down"].dtype == torch.int8
        got_a8 = rows_path_logits(a8, TOKENS)
        assert (got_a8 - expected).abs().max().item() < A8_LOGITS_TOLERANCE * expected.abs().max().item()
        assert not torch.equal(got_a8, got)


def test_speculation_leaves_greedy_output_unchanged_and_auto_defers_to_an_asked_float32(tmp_path):
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
    assert LLM(model=path, dtype="float32").engine.runner.quantization == "none"  # asked for float32
    assert LLM(model=path, dtype="float32", quantization="gguf").engine.runner.quantization == "gguf"
    # int8 activations: other products (a near-tie may part the text), the same exactness
    a8 = LLM(model=path, dtype="bfloat16", kv_cache_memory_bytes=1 << 22, quantization="gguf_a8")
    a8_spec = LLM(model=path, dtype="bfloat16", kv_cache_memory_bytes=1 << 22, quantization="gguf_a8",
                  speculative={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert a8.engine.runner.quantization == "gguf_a8"
    assert a8.engine.runner.model.layers[0].row_weights()["w_gate_up"].dtype == torch.int8  # Q4_1 marked
    a8_expected = [o.token_ids for o in a8.generate(prompts, params)]
    assert [o.token_ids for o in a8_spec.generate(prompts, params)] == a8_expected
    from engine.model_runner import resolve_quantization

    assert resolve_quantization("auto", path, True, "auto") == "gguf"  # (whatever dtype "auto" resolves to)


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
    with pytest.raises(ValueError, match="quantization='gguf_a8' needs .*stores none"):
        LLM(model=f16, quantization="gguf_a8")
    assert LLM(model=f16, dtype="bfloat16").engine.runner.quantization == "none"


# ---- a whole decoder layer at the shapes of published checkpoints ------------------------------
# (hidden, heads, kv heads, head dim, intermediate)
REAL_LAYERS = {"SmolLM2-135M": (576, 9, 3, 64, 1536), "Qwen2.5-0.5B": (896, 14, 2, 64, 4864),
               "Llama-3.2-1B": (2048, 32, 8, 64, 8192)}


@pytest.mark.parametrize("model", list(REAL_LAYERS))
@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_decoder_layer_of_published_shapes_runs_on_gguf_blocks(model, cdtype, activations):
    """rows_layer over Q4_1 blocks (Q8_0 down projection, as mixed files have) at a published
    checkpoint's shapes: against the layer's definition on the dequantized weights in float64 (the
    activations' rounding apart), every row's bits the same alone as in a step of 5 tokens (a
    verification of 4 drafts after a decode token of another request), with the caches' attention
    path this CPU picks for that head layout. int8: the Q4_1 blocks marked for int8 activations
    (`quantization="gguf_a8"`), beside the Q8_0 ones that keep int16."""
    from test_cpu_kernels import reference_attention

    e, h, hkv, d, inter = REAL_LAYERS[model]
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    dense, w = {}, {}
    for key, (n, k, qtype) in {"qkv": ((h + 2 * hkv) * d, e, "Q4_1"), "o": (e, h * d, "Q4_1"),
                               "gate_up": (2 * inter, e, "Q4_1"), "down": (e, inter, "Q8_0")}.items():
        raw, dense[key] = blocks(n, k, qtype, seed=len(dense))
        w["w_" + key] = cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), qtype, k)
        if activations == "int8":
            w["w_" + key] = cpu_kernels.gguf_int8_activations(w["w_" + key])
    assert (w["w_down"].dtype, w["w_qkv"].dtype) == (torch.uint8, torch.int8 if activations == "int8" else torch.uint8)
    w.update(in_norm=1 + 0.1 * torch.randn(e, generator=g), post_norm=1 + 0.1 * torch.randn(e, generator=g))
    bs, blocks_n, t_ = 16, 8, 5
    k_cache = (torch.randn(blocks_n, bs, hkv, d, generator=g) * 0.5).to(cdtype)
    v_cache = (torch.randn(blocks_n, bs, hkv, d, generator=g) * 0.5).to(cdtype)
    tables = torch.tensor([[3, 1, 0, 0]] * 4 + [[6, 2, 0, 0]], dtype=torch.int64)
    positions = torch.tensor([20, 21, 22, 23, 9])
    slots = torch.tensor([int(tables[t, p // bs]) * bs + int(p) % bs for t, p in enumerate(positions)])
    lens = positions + 1
    angles = positions[:, None].float() * torch.linspace(0.05, 1.0, d)[None]
    cos, sin = angles.cos(), angles.sin()
    x, residual = torch.randn(t_, e, generator=g), torch.randn(t_, e, generator=g)
    eps, scale = 1e-5, d**-0.5
    kc, vc = k_cache.clone(), v_cache.clone()
    out, res = cpu_kernels.rows_layer(x, residual, cos, sin, w, kc, vc, slots, tables, lens, h, hkv, inter, eps, scale)

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def rope(v):
        rot = torch.cat([-v[..., d // 2 :], v[..., : d // 2]], dim=-1)
        return v * cos.double()[:, None] + rot * sin.double()[:, None]

    def lin(v, key):
        return v @ torch.from_numpy(dense[key]).T

    ref_res = residual.double() + x.double()
    qkv = lin(rms(ref_res, w["in_norm"]), "qkv")
    q = rope(qkv[:, : h * d].view(t_, h, d))
    k = rope(qkv[:, h * d : (h + hkv) * d].view(t_, hkv, d))
    v = qkv[:, (h + hkv) * d :].view(t_, hkv, d)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for t in range(t_):
        ref_k.view(-1, hkv, d)[slots[t]] = k[t].to(cdtype)
        ref_v.view(-1, hkv, d)[slots[t]] = v[t].to(cdtype)
    a = reference_attention(q.float(), ref_k, ref_v, tables, lens, scale).to(f64)
    ref_res = ref_res + lin(a.reshape(t_, h * d), "o")
    gate, up = lin(rms(ref_res, w["post_norm"]), "gate_up").chunk(2, dim=-1)
    ref_out = lin(torch.nn.functional.silu(gate) * up, "down")
    # bfloat16 caches (and the dot-product attention they take) round q, k, v to bfloat16
    tol = 2e-2 if cdtype == torch.bfloat16 else 2e-3
    if activations == "int8":  # int8's rounding, 0.4% of a 16-input group's largest activation, compounded
        tol = 5e-2
    assert (res.double() - ref_res).abs().max() <= tol * ref_res.abs().max()
    assert (out.double() - ref_out).abs().max() <= tol * ref_out.abs().max()
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    for t in (4, 0, 1, 2, 3):  # the other request's token first, then the drafts in order
        o1, r1 = cpu_kernels.rows_layer(x[t : t + 1].clone(), residual[t : t + 1].clone(), cos[t : t + 1].clone(),
                                        sin[t : t + 1].clone(), w, kc1, vc1, slots[t : t + 1].clone(),
                                        tables[t : t + 1].clone(), lens[t : t + 1].clone(), h, hkv, inter, eps, scale)
        assert torch.equal(o1, out[t : t + 1]) and torch.equal(r1, res[t : t + 1]), t
    assert torch.equal(kc1, kc) and torch.equal(vc1, vc)
