"""The row-invariant CPU kernels (kernels/cpu_gemv.cpp) against torch references, and their
invariance: a row's result is bit-identical alone or next to others."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU row kernels not available (no AVX2/FMA or no compiler)")


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [512, 77])  # 77: the 8-lane and scalar tails
def test_rows_linear_matches_torch_and_is_row_invariant(wdtype, k):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, k, generator=g).to(wdtype)
    b = torch.randn(300, generator=g)
    x = torch.randn(16, k, generator=g)
    y = cpu_kernels.rows_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    for m in range(1, 17):
        assert torch.equal(cpu_kernels.rows_linear(x[:m], w, b), y[:m])
    for i in range(16):
        assert torch.equal(cpu_kernels.rows_linear(x[i : i + 1].clone(), w, b), y[i : i + 1])
    no_bias = torch.nn.functional.linear(x.double(), w.double()).float()
    torch.testing.assert_close(cpu_kernels.rows_linear(x, w, None), no_bias, rtol=1e-5, atol=1e-4)


def test_rows_linear_keeps_the_input_dtype_and_refuses_bad_input():
    w = torch.randn(8, 16)
    assert cpu_kernels.rows_linear(torch.randn(2, 16, dtype=torch.bfloat16), w, None).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="disagree on K"):
        cpu_kernels.rows_linear(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.rows_linear(torch.randn(2, 16), w.half(), None)


def reference_attention(q, k_cache, v_cache, tables, lens, scale):
    """Dense per-token attention in float64 over each token's own context."""
    t_, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(t_, h, d, dtype=torch.float64)
    for t in range(t_):
        n = int(lens[t])
        slots = [int(tables[t, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, hkv, d)[slots].double()  # [n, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].double()
        for hh in range(h):
            kv = hh // (h // hkv)
            p = torch.softmax(k[:, kv] @ q[t, hh].double() * scale, dim=0)
            out[t, hh] = p @ v[:, kv]
    return out


@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16])
def test_rows_attention_matches_a_dense_reference_and_is_row_invariant(cdtype):
    g = torch.Generator().manual_seed(1)
    blocks, bs, hkv, d, h = 12, 4, 2, 32, 4
    k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(cdtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(cdtype)
    # two requests: 3 tokens of one (a verification) at positions 9..11, 1 of another at 6
    tables = torch.tensor([[5, 2, 7, 0], [5, 2, 7, 0], [5, 2, 7, 0], [9, 1, 0, 0]], dtype=torch.int64)
    lens = torch.tensor([10, 11, 12, 7], dtype=torch.int64)
    q = torch.randn(4, h, d, generator=g)
    scale = 1 / math.sqrt(d)
    out = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = reference_attention(q, k_cache, v_cache, tables, lens, scale).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for t in range(4):
        alone = cpu_kernels.rows_attention(q[t : t + 1].clone(), k_cache, v_cache, tables[t : t + 1], lens[t : t + 1], scale)
        assert torch.equal(alone, out[t : t + 1])
    with pytest.raises(RuntimeError, match="ctx_lens out of range"):
        cpu_kernels.rows_attention(q[:1], k_cache, v_cache, tables[:1], torch.tensor([17]), scale)
