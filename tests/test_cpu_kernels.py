"""The row-invariant CPU kernels (kernels/csrc/) against torch references, and their
invariance: a row's result is bit-identical alone or next to others."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU row kernels not available (no AVX2/FMA or no compiler)")

# Weight dtypes and packed layouts: "plain" (widened to float32, AVX2 FMAs) for both dtypes, and
# "dot_bf16" (AVX512-BF16 dot products over activations rounded to bfloat16) where the CPU has it.
DOT_BF16 = pytest.param(torch.bfloat16, "dot_bf16", id="bfloat16-dot_bf16", marks=pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.dot_bf16_available(), reason="no AVX512-BF16 on this CPU"))
NO_TREE = torch.empty(0, dtype=torch.int64)  # RowsStack's tree argument: none
WEIGHTS = [pytest.param(torch.float32, "plain", id="float32"), pytest.param(torch.bfloat16, "plain", id="bfloat16"),
           DOT_BF16]


def pack(w: torch.Tensor, layout: str) -> torch.Tensor:
    return cpu_kernels.pack_rows(w, dot_bf16=layout == "dot_bf16")


def x_ref(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The activations as the products take them, in float64: rounded to bfloat16 for dot_bf16."""
    return (x.to(torch.bfloat16) if layout == "dot_bf16" else x).double()


def test_the_kernels_exp_is_accurate_and_element_wise():
    """The vectorized exp of the softmax and SiLU (cpu_kernels.h exp8): within 2 ulp of exp over
    the float range it serves, 0 below -87.34 (no denormals), saturated above 88.376, and a value's
    result does not depend on where it sits (8-wide body or zero-padded tail)."""
    m = cpu_kernels._module()
    x = torch.linspace(-87.3, 88.37, 1_000_003, dtype=torch.float32)
    y, ref = m.exp_f32(x).double(), torch.exp(x.double())
    assert ((y - ref) / ref).abs().max().item() <= 2 * 2.0**-24
    edge = m.exp_f32(torch.tensor([-1000.0, -87.4, 0.0, 89.0]))
    assert edge[0] == 0 and edge[1] == 0 and edge[2] == 1 and math.isfinite(edge[3]) and edge[3] > 2e38
    for n in (1, 7, 8, 13):  # the same value in every lane of the body and of the tail
        v = torch.full((n,), -3.7)
        assert torch.equal(m.exp_f32(v), m.exp_f32(torch.tensor([-3.7])).expand(n))


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


@pytest.mark.parametrize(("wdtype", "layout"), WEIGHTS)
def test_packed_linear_over_row_tiles_is_row_invariant(wdtype, layout):
    """A prefill-sized product (rows in several tiles of the kernel's M_TILE = 48, the last one
    partial) gives each row the bits it gets alone, and matches float64."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 136, generator=g).to(wdtype)
    x = torch.randn(101, 136, generator=g)
    packed = pack(w, layout)
    y = cpu_kernels.packed_linear(x, packed, 70, None)
    torch.testing.assert_close(y, torch.nn.functional.linear(x_ref(x, layout), w.double()).float(), rtol=1e-5, atol=1e-4)
    for i in (0, 47, 48, 50, 96, 100):
        assert torch.equal(cpu_kernels.packed_linear(x[i : i + 1].clone(), packed, 70, None), y[i : i + 1])


@pytest.mark.parametrize(("wdtype", "layout"), WEIGHTS)
def test_packed_linear_gives_a_row_its_bits_at_every_row_count(wdtype, layout):
    """Verification- and batch-sized products, 1..20 rows (the dot_bf16 layout runs more than 6
    rows as groups taking turns over chunks of 64 pairs of k: 300 columns are 3 chunks, the last
    partial), and a full 48-row tile: each row has the bits it gets alone, whatever group and
    chunk it ran in, and the products match float64."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(130, 300, generator=g).to(wdtype)  # 130 outputs: 3 blocks of 64, the last partial
    x = torch.randn(48, 300, generator=g)
    packed = pack(w, layout)
    alone = torch.cat([cpu_kernels.packed_linear(x[i : i + 1].clone(), packed, 130, None) for i in range(48)])
    torch.testing.assert_close(alone, torch.nn.functional.linear(x_ref(x, layout), w.double()).float(),
                               rtol=1e-5, atol=1e-4)
    for m in [*range(2, 21), 48]:
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, 130, None), alone[:m]), m


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="no AMX-BF16 on this CPU (or the OS refused the tile state)")
def test_amx_products_give_a_row_its_bits_at_every_row_count():
    """On an AMX CPU the dp-packed products whose K is a multiple of 32 run on tiles: a row has the
    bits it gets alone at 1-20 rows (one tile), 33 and 101 rows (tiles of 16, the last padded with
    zero rows) and with a bias; the products match float64; and the path really ran: its bits are
    not the AVX512-BF16 path's (another order of additions), which a K off the multiple keeps."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 320, generator=g).to(torch.bfloat16)  # 130 outputs: 3 blocks, the last partial
    x, b = torch.randn(101, 320, generator=g), torch.randn(130, generator=g)
    packed = pack(w, "dot_bf16")
    alone = torch.cat([cpu_kernels.packed_linear(x[i : i + 1].clone(), packed, 130, b) for i in range(101)])
    ref = torch.nn.functional.linear(x_ref(x, "dot_bf16"), w.double(), b.double()).float()
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-4)
    for m in [*range(2, 21), 33, 101]:
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, 130, b), alone[:m]), m
    before = cpu_kernels.amx_products(False)
    try:
        avx512 = cpu_kernels.packed_linear(x, packed, 130, b)
        odd_k = pack(w[:, :300], "dot_bf16")
        odd_avx512 = cpu_kernels.packed_linear(x[:, :300], odd_k, 130, b)
    finally:
        cpu_kernels.amx_products(before)
    assert before and not torch.equal(avx512, alone)
    torch.testing.assert_close(avx512, alone, rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu_kernels.packed_linear(x[:, :300], odd_k, 130, b), odd_avx512)


def int8_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """linear_i8 from its definition (csrc/products.cpp): each weight row int8 at max|w| / 127, each
    x row int16 at max|x| / A (A = min(32767, floor((2^31 - 1) / (127 K2)))), an exact integer
    sum, times both scales (float32 arithmetic as the kernel's)."""
    k2 = (w.shape[1] + 1) // 2 * 2
    a = min(32767.0, math.floor(2147483647.0 / (127.0 * k2)))
    sw = w.float().abs().amax(dim=1) / 127.0
    qw = torch.round(w.float() / sw[:, None]).clamp(-127, 127)
    sx = x.abs().amax(dim=1) / a
    qx = torch.round(x / sx[:, None]).nan_to_num(0.0)  # a zero row: zeros
    y = (qx.double() @ qw.double().T).float() * (sx[:, None] * sw[None, :])
    return y + b if b is not None else y


@pytest.mark.skipif(not cpu_kernels.int8_available(), reason="int8 products need AVX512-VNNI")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_int8_products_follow_their_definition_and_are_row_invariant(wdtype):
    """pack_rows_int8 + packed_linear (a drafter's int8 weights): the products of the definition
    (to float32 rounding: the kernel may fuse the bias add), within 1.5% of the exact products for
    Gaussian weights, each row the same bits alone or in groups of 1-20 rows (odd K: a padded
    pair), a zero row gives the bias, and the int8 layout is told apart from the others."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(130, 301, generator=g).to(wdtype)
    x, b = torch.randn(20, 301, generator=g), torch.randn(130, generator=g)
    x[3] = 0.0
    packed = cpu_kernels.pack_rows_int8(w)
    assert packed.dtype == torch.int8 and packed.shape == (3, 64 * 302 + 256)
    y = cpu_kernels.packed_linear(x, packed, 130, b)
    torch.testing.assert_close(y, int8_reference(x, w, b), rtol=1e-6, atol=1e-5)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 0.015
    assert torch.equal(y[3], b)
    alone = torch.cat([cpu_kernels.packed_linear(x[i : i + 1].clone(), packed, 130, b) for i in range(20)])
    assert torch.equal(alone, y)
    for m in range(1, 21):
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, 130, b), y[:m]), m
    with pytest.raises(RuntimeError, match="int8-packed weights of 130 x 300 expected"):
        cpu_kernels.packed_linear(x[:, :300].contiguous(), packed, 130, b)


def int4_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """linear_i4 from its definition (csrc/products.cpp): per weight row and group of 32 k a scale
    s = bfloat16(max|w| / 7), q = clamp(round(w / s), -7, 7); each x row int16 at max|x| / 32767;
    per group an exact integer sum, times s, added group by group in float32; times x's scale."""
    n, k = w.shape
    wg = w.float().view(n, k // 32, 32)
    s = (wg.abs().amax(dim=2) / 7.0).bfloat16().float()  # [n, groups]
    q = torch.where(s[:, :, None] > 0, torch.round(wg / s[:, :, None]).clamp(-7, 7), torch.zeros_like(wg))
    sx = x.abs().amax(dim=1) / 32767.0
    qx = torch.round(x / sx[:, None]).nan_to_num(0.0).view(x.shape[0], k // 32, 32)
    sums = torch.einsum("mgk,ngk->mng", qx.double(), q.double()).float()  # exact integers
    y = torch.zeros(x.shape[0], n)
    for g in range(k // 32):
        y = y + sums[:, :, g] * s[None, :, g]
    y = y * sx[:, None]
    return y + b if b is not None else y


@pytest.mark.skipif(not cpu_kernels.int8_available(), reason="int4 products need AVX512-VNNI")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_int4_products_follow_their_definition_and_are_row_invariant(wdtype):
    """pack_rows_int4 + packed_linear (a drafter's int4 weights, a scale per group of 32): the
    products of the definition (to float32 rounding: the kernel fuses multiply-adds), within 15%
    (in norm) of the exact products for Gaussian weights and about 9% as int4 of this kind gives,
    each row the same bits alone or in groups of 1-20 rows, a zero row gives the bias, a block's
    padding rows (130 = 2 x 64 + 2) stay out, K must be a multiple of 32 and the layout is told
    apart from the others. Negative control: one nibble of the packing moved changes the product."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(130, 320, generator=g) * 0.1).to(wdtype)
    w[7, 40:72] = 0.0  # a zero group: scale 0
    x, b = torch.randn(20, 320, generator=g), torch.randn(130, generator=g)
    x[3] = 0.0
    packed = cpu_kernels.pack_rows_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 36 * 320)
    y = cpu_kernels.packed_linear(x, packed, 130, b)
    torch.testing.assert_close(y, int4_reference(x, w, b), rtol=1e-5, atol=1e-5)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    rel = ((y - b - (exact - b)).norm() / (exact - b).norm()).item()
    assert 0.03 < rel < 0.15, rel
    assert torch.equal(y[3], b)
    alone = torch.cat([cpu_kernels.packed_linear(x[i : i + 1].clone(), packed, 130, b) for i in range(20)])
    assert torch.equal(alone, y)
    for m in range(1, 21):
        assert torch.equal(cpu_kernels.packed_linear(x[:m], packed, 130, b), y[:m]), m
    moved = packed.clone()
    moved[0, 0] ^= 0x01  # row 0's first weight, one step of q
    assert not torch.equal(cpu_kernels.packed_linear(x, moved, 130, b)[:, 0], y[:, 0])
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        cpu_kernels.pack_rows_int4(w[:, :300])
    with pytest.raises(RuntimeError, match="int4-packed weights of 130 x 288 expected"):
        cpu_kernels.packed_linear(x[:, :288].contiguous(), packed, 130, b)


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


@pytest.fixture
def float32_attention():
    """The float32 attention kernels for bfloat16 caches too (not `attention_rows_dp`)."""
    before = cpu_kernels.dot_attention(False)
    yield
    cpu_kernels.dot_attention(before)


@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16])
def test_rows_attention_matches_a_dense_reference_and_is_row_invariant(cdtype, float32_attention):
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


@pytest.mark.skipif(not cpu_kernels.has_avx512(), reason="the 512-bit attention kernel needs AVX-512")
@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hkv", "group", "d"), [(4, 2, 64), (2, 4, 32), (1, 8, 128), (3, 1, 16), (2, 3, 256), (5, 1, 64)])
@pytest.mark.parametrize(("threads", "bs"), [(1, 16), (2, 16), (1, 1)])  # bs 1: slot tables (token trees)
def test_the_512_bit_attention_has_the_256_bit_kernels_bits(cdtype, hkv, group, d, threads, bs, float32_attention):
    """The AVX-512 kernel (scores' reductions 4 at a time, position-major softmax, output in
    registers, prefetches, a request's consecutive tokens taken together) must compute every
    (token, head) exactly as the AVX2 one, which takes each token alone: both serve the same
    engine, and row exactness is stated against either."""
    g = torch.Generator().manual_seed(hkv * 100 + d)
    blocks, h = 640 // bs, hkv * group
    k_cache = (torch.randn(blocks, bs, hkv, d, generator=g) * 3).to(cdtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(cdtype)
    tables, lens = _tokens_and_groups(blocks, bs, g)
    t_ = len(lens)
    q = torch.randn(t_, h, d, generator=g)
    q[2, 0] = 0.0  # every score 0 for one head
    scale = 1 / math.sqrt(d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, scale)
        cpu_kernels.wide_attention(False)
        try:
            narrow = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, scale)
        finally:
            assert cpu_kernels.wide_attention(True) is False
    finally:
        torch.set_num_threads(before)
    assert torch.equal(wide, narrow)
    ref = reference_attention(q, k_cache, v_cache, tables, lens, scale).float()
    torch.testing.assert_close(wide, ref, rtol=1e-5, atol=1e-5)


def _tokens_and_groups(blocks: int, bs: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths of lone tokens and of two verifications (a request's
    consecutive tokens): 11 of one request (more than a work item takes) and 3 of another from its
    first position."""
    table = [torch.randperm(blocks, generator=g)[: 96 // bs] for _ in range(10)]
    tables = torch.stack(table[:7] + [table[7]] * 11 + [table[8]] * 3 + [table[9]])
    lens = torch.tensor([1, 15, 16, 17, 40, 95, 96, *range(50, 61), 1, 2, 3, 40], dtype=torch.int64)
    return tables, lens


def _bf16_attention_against_its_definition(hkv, group, d, threads, bs):
    """(the kernel's output, the definition's in float64, the float32 kernels' output) over
    `_tokens_and_groups`, after checking that each token's result is the same bits alone."""
    g = torch.Generator().manual_seed(d + bs)
    blocks, h = 640 // bs, hkv * group
    k_cache = (torch.randn(blocks, bs, hkv, d, generator=g) * 3).bfloat16()
    v_cache = torch.randn(blocks, bs, hkv, d, generator=g).bfloat16()
    tables, lens = _tokens_and_groups(blocks, bs, g)
    q = torch.randn(len(lens), h, d, generator=g)
    scale = 1 / math.sqrt(d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, scale)
        alone = [cpu_kernels.rows_attention(q[t : t + 1].clone(), k_cache, v_cache, tables[t : t + 1], lens[t : t + 1], scale)
                 for t in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.cat(alone), out)
    ref = torch.empty(q.shape, dtype=torch.float64)
    qb = q.bfloat16().double()
    for t in range(len(lens)):
        n = int(lens[t])
        slots = [int(tables[t, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, hkv, d)[slots].double()
        v = v_cache.reshape(-1, hkv, d)[slots].double()
        for hh in range(h):
            kv = hh // group
            s_ = (k[:, kv] @ qb[t, hh]).float() * scale  # (the kernel scales the float32 score)
            e = torch.exp(s_.double() - s_.double().max())
            ref[t, hh] = (e.float().bfloat16().double() @ v[:, kv]) / e.sum()
    before = cpu_kernels.dot_attention(False)
    try:
        float32 = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, scale)
    finally:
        cpu_kernels.dot_attention(before)
    return out, ref, float32


@pytest.mark.skipif(not cpu_kernels.dot_bf16_available(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize(("hkv", "group", "d"), [(4, 2, 64), (2, 4, 32), (1, 8, 128), (2, 3, 256)])
@pytest.mark.parametrize(("threads", "bs"), [(1, 16), (2, 16), (1, 1)])
def test_dot_product_attention_matches_its_definition_and_is_row_invariant(hkv, group, d, threads, bs):
    """bfloat16 caches on AVX512-BF16 (csrc/attention.cpp attention_rows_dp; the AMX tiles' kernel off):
    scores from q rounded to bfloat16, the softmax weights rounded to bfloat16 against the values
    and divided by the unrounded sum, against that definition in float64; a token's result is
    bit-identical alone, in a verification group, or next to other requests, with 1 or 2 threads;
    and it is not the float32 kernels' result (the path ran)."""
    before = cpu_kernels.amx_attention(False)
    try:
        out, ref, float32 = _bf16_attention_against_its_definition(hkv, group, d, threads, bs)
    finally:
        cpu_kernels.amx_attention(before)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    assert not torch.equal(float32, out)


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="no AMX tiles on this CPU (or SPECDECODE_CPU_AMX=0)")
@pytest.mark.parametrize(("hkv", "group", "d"), [(4, 2, 64), (1, 8, 128), (2, 3, 256), (1, 16, 64), (2, 1, 64)])
@pytest.mark.parametrize(("threads", "bs"), [(1, 16), (2, 16), (1, 32)])
def test_amx_attention_matches_its_definition_and_is_row_invariant(hkv, group, d, threads, bs):
    """bfloat16 caches on AMX tiles (csrc/attention.cpp attention_rows_amx): the same definition as the
    dot-product kernel's, with the scores' float32 sums in the tiles' order. A score a few float32
    ulps away can round a softmax weight to the neighbouring bfloat16 (2^-8 of it), so the bound is
    that of one such weight per output (4e-3 for these unit values), and the error is that small
    almost everywhere (99% within 2e-5: a flipped weight moves its head's whole row); a token's result is
    bit-identical alone, grouped (11 tokens: parts of 16 / group query rows) or next to other
    requests, with 1 or 2 threads; it is neither the dot-product kernel's bits (the path ran) nor
    further from it than from the definition."""
    before = cpu_kernels.amx_attention(True)
    try:
        out, ref, _ = _bf16_attention_against_its_definition(hkv, group, d, threads, bs)
        cpu_kernels.amx_attention(False)
        dp, _, _ = _bf16_attention_against_its_definition(hkv, group, d, threads, bs)
    finally:
        cpu_kernels.amx_attention(before)
    err = (out.double() - ref).abs()
    assert err.max().item() < 4e-3
    assert (err < 2e-5).double().mean().item() > 0.99
    assert not torch.equal(out, dp)
    assert (out - dp).abs().max().item() < 4e-3


def _tree_step(g, bs: int, num_nodes: int, context: int):
    """A step of two requests on bfloat16 caches: request 0 a causal token; request 1 `context`
    positions then a token tree of num_nodes nodes with random parents (its root at position
    `context`), its query tokens the tree's nodes. Returns (caches, tables, causal lens, tree rows
    [T, 2], slot tables and lens of what each token sees, in position order)."""
    blocks = 2 * (-(-(context + num_nodes) // bs)) + 2
    k_cache = (torch.randn(blocks, bs, 2, 64, generator=g) * 3).bfloat16()
    v_cache = torch.randn(blocks, bs, 2, 64, generator=g).bfloat16()
    order = torch.randperm(blocks, generator=g).tolist()
    table_a, table_b = order[: blocks // 2], order[blocks // 2 :]
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, num_nodes)]
    seen = []
    for i in range(num_nodes):
        row, j = 0, i
        while j >= 0:
            row |= 1 << j
            j = parents[j]
        seen.append(row)
    width = len(table_b)
    tables = torch.tensor([table_a + [0] * (width - len(table_a))] + [table_b] * num_nodes)
    lens = torch.tensor([17] + [context + i + 1 for i in range(num_nodes)])
    tree = torch.tensor([(-1, 0)] + [(context, r - (1 << 64) if r >= 1 << 63 else r) for r in seen])
    slot = [lambda p, t=t: int(tables[t, p // bs]) * bs + p % bs for t in range(len(lens))]
    rows = [[slot[0](p) for p in range(17)]] + [
        [slot[1 + i](p) for p in range(context)] + [slot[1 + i](context + j) for j in range(i + 1) if seen[i] >> j & 1]
        for i in range(num_nodes)]
    slot_tables = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    for t, r in enumerate(rows):
        slot_tables[t, : len(r)] = torch.tensor(r)
    return k_cache, v_cache, tables, lens, tree, slot_tables, torch.tensor([len(r) for r in rows])


@pytest.mark.skipif(not cpu_kernels.dot_bf16_available(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("num_nodes", [5, 17, 64])
@pytest.mark.parametrize("amx", [False, True])
def test_tree_attention_is_attention_over_what_each_node_sees(num_nodes, amx):
    """Token trees (`tree` rows: the root's position and each node's mask row) in a causal step
    with another request: each node attends to the context, its ancestors and itself. With the
    tile kernel off, the same bits as the dot-product kernel over each token's slot table (the
    rows it sees, in position order); on AMX tiles, within one flipped bfloat16 weight of that
    (the unseen nodes masked in the tiles' lanes) and the same bits alone or grouped. A wrong mask
    bit changes the output (negative control)."""
    if amx and not cpu_kernels.amx_available():
        pytest.skip("no AMX tiles on this CPU (or SPECDECODE_CPU_AMX=0)")
    g = torch.Generator().manual_seed(num_nodes)
    k_cache, v_cache, tables, lens, tree, slot_tables, slot_lens = _tree_step(g, 16, num_nodes, 40)
    q = torch.randn(len(lens), 4, 64, generator=g)
    before = cpu_kernels.amx_attention(amx)
    try:
        out = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, tree)
        alone = [cpu_kernels.rows_attention(q[t : t + 1].clone(), k_cache, v_cache, tables[t : t + 1], lens[t : t + 1],
                                            0.125, tree[t : t + 1].clone()) for t in range(len(lens))]
        wrong = tree.clone()
        wrong[-1, 1] ^= 1 << (num_nodes - 2)  # the last node sees one more or one fewer earlier node
        changed = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, wrong)
        cpu_kernels.amx_attention(False)
        by_slots = cpu_kernels.rows_attention(q, k_cache.view(-1, 1, 2, 64), v_cache.view(-1, 1, 2, 64), slot_tables,
                                              slot_lens, 0.125)
    finally:
        cpu_kernels.amx_attention(before)
    assert torch.equal(torch.cat(alone), out)
    assert not torch.equal(changed[-1], out[-1]) and torch.equal(changed[:-1], out[:-1])
    if amx:
        err = (out - by_slots).abs()
        assert err.max().item() < 4e-3 and (err < 2e-5).double().mean().item() > 0.99
    else:
        assert torch.equal(out, by_slots)


@pytest.mark.parametrize("num_nodes", [5, 17, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_attention_on_the_portable_kernel(num_nodes, dtype):
    """The portable attention kernel (AVX2; every other kernel switched off) takes token trees over
    the block tables, skipping each node's unseen nodes: the same bits as over each token's slot
    table (the rows it sees, in position order), alone or with the other tokens; a wrong mask bit
    changes the output (negative control)."""
    g = torch.Generator().manual_seed(100 + num_nodes)
    k_cache, v_cache, tables, lens, tree, slot_tables, slot_lens = _tree_step(g, 16, num_nodes, 40)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(len(lens), 4, 64, generator=g)
    before = (cpu_kernels.wide_attention(False), cpu_kernels.dot_attention(False), cpu_kernels.amx_attention(False))
    try:
        out = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, tree)
        alone = [cpu_kernels.rows_attention(q[t : t + 1].clone(), k_cache, v_cache, tables[t : t + 1], lens[t : t + 1],
                                            0.125, tree[t : t + 1].clone()) for t in range(len(lens))]
        wrong = tree.clone()
        wrong[-1, 1] ^= 1 << (num_nodes - 2)
        changed = cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, wrong)
        by_slots = cpu_kernels.rows_attention(q, k_cache.view(-1, 1, 2, 64), v_cache.view(-1, 1, 2, 64), slot_tables,
                                              slot_lens, 0.125)
    finally:
        cpu_kernels.wide_attention(before[0])
        cpu_kernels.dot_attention(before[1])
        cpu_kernels.amx_attention(before[2])
    assert torch.equal(out, by_slots)
    assert torch.equal(torch.cat(alone), out)
    assert not torch.equal(changed[-1], out[-1]) and torch.equal(changed[:-1], out[:-1])


def test_tree_rows_are_checked():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables, lens, tree, _, _ = _tree_step(g, 16, 5, 40)
    q = torch.randn(len(lens), 4, 64, generator=g)
    for bad in ([(40, 0b10)], [(40, 0b1)], [(lens[2].item(), 1)]):  # no root; not itself; the root after it
        wrong = tree.clone()
        wrong[2] = torch.tensor(bad[0])
        with pytest.raises(RuntimeError, match="must be one of its 64 first nodes, seeing the root and itself"):
            cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, wrong)
    with pytest.raises(RuntimeError, match="tree must be contiguous int64"):
        cpu_kernels.rows_attention(q, k_cache, v_cache, tables, lens, 0.125, tree[:, :1].contiguous())


# --- packed weights ---------------------------------------------------------------------------
@pytest.mark.parametrize(("wdtype", "layout"), WEIGHTS)
@pytest.mark.parametrize(("n", "k"), [(301, 77), (6, 5), (8, 16), (9, 64), (128, 33)])  # partial blocks; K tails; none
def test_packed_linear_matches_a_reference_for_any_grouping_of_rows(wdtype, layout, n, k):
    """Rows are computed several (plain: up to 3, dot_bf16: up to 6), fewer or one at a time
    against each weight load depending on M: a row's result must not depend on that (nor on its
    place), and must match float64."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g)
    x = torch.randn(13, k, generator=g)
    packed = pack(w, layout)
    shape = (-(-n // 64), 64 * (-(-k // 2) * 2)) if layout == "dot_bf16" else (-(-n // 4) * 4, k)
    assert packed.shape == shape and packed.dtype == wdtype
    y = cpu_kernels.packed_linear(x, packed, n, b)
    ref = torch.nn.functional.linear(x_ref(x, layout), w.double(), b.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    for start in range(13):
        for stop in range(start + 1, 14):
            assert torch.equal(cpu_kernels.packed_linear(x[start:stop].clone(), packed, n, b), y[start:stop])
    if layout == "plain":
        assert torch.equal(cpu_kernels.rows_linear(x, w, b), y)
    with pytest.raises(RuntimeError, match="packed weights of"):  # n in another block (4 rows; dot_bf16: 64)
        cpu_kernels.packed_linear(x, packed, n + (64 if layout == "dot_bf16" else 4), None)


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.dot_bf16_available(), reason="no AVX512-BF16 on this CPU")
def test_dot_bf16_rounds_activations_like_torch_and_refuses_float32_weights():
    """dot_bf16 takes x as torch's `.to(torch.bfloat16)` rounds it (nearest even; large, tiny and
    negative values; NaN stays NaN): the product of x equals that of x rounded beforehand, bit for
    bit; float32 weights cannot be packed for it; `SPECDECODE_CPU_BF16_DOT=0` turns it off."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 40, generator=g).to(torch.bfloat16)
    packed = pack(w, "dot_bf16")
    x = torch.randn(5, 40, generator=g) * torch.logspace(-30, 30, 40)
    x[1, 3] = float("nan")
    y = cpu_kernels.packed_linear(x, packed, 12, None)
    assert torch.equal(y[[0, 2, 3, 4]], cpu_kernels.packed_linear(x.to(torch.bfloat16).float(), packed, 12, None)[[0, 2, 3, 4]])
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2, 3, 4]]).any()
    with pytest.raises(RuntimeError, match="dot_bf16 needs bfloat16 weights"):
        cpu_kernels.pack_rows(w.float(), dot_bf16=True)
    assert cpu_kernels.pack_rows(w).shape == packed.shape  # the default for bfloat16 weights here


def test_dot_bf16_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_BF16_DOT, "0")
    assert not cpu_kernels.dot_bf16_available()
    assert cpu_kernels.pack_rows(torch.randn(8, 16).to(torch.bfloat16)).shape == (8, 16)


# --- the fused decoder layer ------------------------------------------------------------------
E, H, HKV, D, INTER, EPS = 64, 4, 2, 16, 96, 1e-5


def random_layer(wdtype, qk_norm: bool, bias: bool, in_norm: bool, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    q, kv = H * D, HKV * D
    w = {
        "in_norm": 1 + r(E) if in_norm else None, "post_norm": 1 + r(E),
        "w_qkv": r(q + 2 * kv, E).to(wdtype), "b_qkv": r(q + 2 * kv) if bias else None,
        "w_o": r(E, q).to(wdtype), "b_o": r(E) if bias else None,
        "q_norm": 1 + r(D) if qk_norm else None, "k_norm": 1 + r(D) if qk_norm else None,
        "w_gate_up": r(2 * INTER, E).to(wdtype), "b_gate_up": r(2 * INTER) if bias else None,
        "w_down": r(E, INTER).to(wdtype), "b_down": r(E) if bias else None,
    }
    return w


def packed(w: dict, layout: str = "plain") -> dict:
    return {k: pack(v, layout) if k.startswith("w_") else v for k, v in w.items()}


def reference_layer(x, residual, cos, sin, w, k_cache, v_cache, slots, tables, lens, scale, layout="plain"):
    """The layer from its definition in float64 (weights as given; each product's input rounded
    to bfloat16 for the dot_bf16 layout); writes K/V into the caches (rounded to their dtype, as
    the kernel stores them)."""
    d = torch.float64

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()

    def lin(v, name):
        out = x_ref(v.float(), layout) @ w["w_" + name].double().T
        return out if w["b_" + name] is None else out + w["b_" + name].double()

    def rope(v):  # [T, heads, D]
        half = D // 2
        rot = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
        return v * cos.double()[:, None] + rot * sin.double()[:, None]

    t_ = x.shape[0]
    res = x.double() if residual is None else residual.double() + x.double()
    h = rms(res, w["in_norm"]) if w["in_norm"] is not None else res
    qkv = lin(h, "qkv")
    q = qkv[:, : H * D].view(t_, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(t_, HKV, D)
    v = qkv[:, (H + HKV) * D :].view(t_, HKV, D)
    if w["q_norm"] is not None:
        q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
    q, k = rope(q), rope(k)
    for t in range(t_):
        if slots[t] >= 0:
            k_cache.view(-1, HKV, D)[slots[t]] = k[t].to(k_cache.dtype)
            v_cache.view(-1, HKV, D)[slots[t]] = v[t].to(v_cache.dtype)
    a = reference_attention(q.float(), k_cache, v_cache, tables, lens, scale).to(d)
    res = res + lin(a.reshape(t_, H * D), "o")
    gate, up = lin(rms(res, w["post_norm"]), "gate_up").chunk(2, dim=-1)
    return lin(torch.nn.functional.silu(gate) * up, "down"), res


def layer_inputs(cdtype, seed=4):
    g = torch.Generator().manual_seed(seed)
    blocks, bs = 12, 4
    k_cache = (torch.randn(blocks, bs, HKV, D, generator=g) * 0.5).to(cdtype)
    v_cache = (torch.randn(blocks, bs, HKV, D, generator=g) * 0.5).to(cdtype)
    # a verification of 3 tokens of one request (positions 9..11) and one decode token (position 6)
    tables = torch.tensor([[5, 2, 7, 0], [5, 2, 7, 0], [5, 2, 7, 0], [9, 1, 0, 0]], dtype=torch.int64)
    positions = torch.tensor([9, 10, 11, 6])
    slots = torch.tensor([int(tables[t, p // bs]) * bs + int(p) % bs for t, p in enumerate(positions)])
    lens = positions + 1
    angles = positions[:, None].float() * torch.linspace(0.1, 1.0, D)[None]
    x = torch.randn(4, E, generator=g)
    residual = torch.randn(4, E, generator=g)
    return x, residual, angles.cos(), angles.sin(), k_cache, v_cache, slots, tables, lens


@pytest.mark.parametrize(("wdtype", "layout"), WEIGHTS)
@pytest.mark.parametrize(("qk_norm", "bias", "in_norm"), [(False, False, True), (True, True, True), (False, True, False)])
def test_rows_layer_matches_its_definition_and_is_row_invariant(wdtype, layout, qk_norm, bias, in_norm):
    cdtype = wdtype
    w = random_layer(wdtype, qk_norm, bias, in_norm)
    wp = packed(w, layout)
    x, residual, cos, sin, k_cache, v_cache, slots, tables, lens = layer_inputs(cdtype)
    scale = D**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_out, ref_res = reference_layer(x, residual, cos, sin, w, ref_k, ref_v, slots, tables, lens, scale, layout)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, res = cpu_kernels.rows_layer(x, residual, cos, sin, wp, kc, vc, slots, tables, lens, H, HKV, INTER, EPS, scale)
    # dot_bf16 rounds each product's input to bfloat16: where the reference's float64 value and
    # the kernel's float32 one sit on either side of a rounding boundary, they part by one
    # bfloat16 step (2^-8 relative) of that input, hence the bfloat16-sized tolerance.
    tol = dict(rtol=1e-2, atol=4e-3) if layout == "dot_bf16" else dict(rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(res, ref_res.float(), **(tol if layout == "dot_bf16" else dict(rtol=1e-4, atol=1e-4)))
    torch.testing.assert_close(out, ref_out.float(), **tol)
    torch.testing.assert_close(kc.float(), ref_k.float(), rtol=1e-2 if cdtype == torch.bfloat16 else 1e-5, atol=1e-5)
    # One token per call, in position order (decode steps): the same bits, the same cache.
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    for t in range(4):
        o1, r1 = cpu_kernels.rows_layer(x[t : t + 1].clone(), residual[t : t + 1].clone(), cos[t : t + 1].clone(),
                                        sin[t : t + 1].clone(), wp, kc1, vc1, slots[t : t + 1].clone(),
                                        tables[t : t + 1].clone(), lens[t : t + 1].clone(), H, HKV, INTER, EPS, scale)
        assert torch.equal(o1, out[t : t + 1]) and torch.equal(r1, res[t : t + 1])
    assert torch.equal(kc1, kc) and torch.equal(vc1, vc)


def test_rows_layer_skips_slot_minus_one_and_refuses_bad_input():
    w = packed(random_layer(torch.float32, False, False, True))
    x, residual, cos, sin, k_cache, v_cache, slots, tables, lens = layer_inputs(torch.float32)
    kc = k_cache.clone()
    skip = slots.clone()
    skip[3] = -1
    cpu_kernels.rows_layer(x, None, cos, sin, w, kc, v_cache.clone(), skip, tables, lens, H, HKV, INTER, EPS, 0.25)
    assert torch.equal(kc.view(-1, HKV, D)[slots[3]], k_cache.view(-1, HKV, D)[slots[3]])
    assert not torch.equal(kc.view(-1, HKV, D)[slots[0]], k_cache.view(-1, HKV, D)[slots[0]])
    with pytest.raises(RuntimeError, match="w_gate_up: packed weights of"):
        cpu_kernels.rows_layer(x, None, cos, sin, w, kc, v_cache, slots, tables, lens, H, HKV, INTER + 4, EPS, 0.25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.rows_layer(x, None, cos, sin, w, kc, v_cache, slots, tables + 100, lens, H, HKV, INTER, EPS, 0.25)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.rows_layer(x, None, cos, sin, w, kc, v_cache, slots + k_cache.shape[0] * k_cache.shape[1], tables,
                               lens, H, HKV, INTER, EPS, 0.25)
    unpacked = random_layer(torch.float32, False, False, True)
    with pytest.raises(RuntimeError, match="packed weights of"):
        cpu_kernels.rows_layer(x, None, cos, sin, unpacked | {"w_qkv": unpacked["w_qkv"][:-1]}, kc, v_cache, slots,
                               tables, lens, H, HKV, INTER, EPS, 0.25)


# --- the fused path in the model, against the torch reference path -----------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_step_matches_the_torch_path(tmp_path, family, dtype):
    """A verification step (4 tokens) and a decode step through the fused row path (exact
    "rows") against the same steps through the torch path (exact "off": BLAS + SDPA), after the
    same prefill: logits within tolerance (float32 close to rounding; bfloat16: the torch path
    rounds activations to bfloat16 between ops, the fused path keeps them in float32), and the
    greedy tokens equal."""
    from helpers import save_tiny_model

    from engine.model_runner import ModelRunner, SeqChunk

    path = save_tiny_model(str(tmp_path / family), family)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    prompt, tokens = list(range(3, 40)), [41, 7, 19, 23]
    logits = {}
    for exact in ("rows", "off"):
        r = ModelRunner(path, torch.device("cpu"), dt, 256, "torch", exact)
        r.init_kv_cache(16, 16)
        with torch.inference_mode():
            r.forward([SeqChunk(prompt, 0, [0, 1, 2])])
            chunks = [SeqChunk(tokens, len(prompt), [0, 1, 2])]
            _, h = r.forward(chunks)
            verify = r.logits(h, r.tile_rows(chunks))
            chunks = [SeqChunk([tokens[0]], len(prompt), [0, 1, 2])]
            _, h = r.forward(chunks)
            decode = r.logits(h, r.tile_rows(chunks))
        assert (r.tile_rows(chunks) == -1) == (exact == "rows")
        logits[exact] = (verify, decode)
    tol = {"float32": (1e-4, 1e-4), "bfloat16": (0.05, 0.05)}[dtype]
    for fused, ref in zip(logits["rows"], logits["off"], strict=True):
        torch.testing.assert_close(fused, ref, rtol=tol[0], atol=tol[1])
        assert torch.equal(fused.argmax(-1), ref.argmax(-1))


def test_kernels_release_the_gil_while_they_compute():
    """A replica's other Python threads (Ray Serve's event loops, gRPC) must run while the engine
    thread is inside a kernel. A Python thread timestamps its loop; none of its timestamps can
    fall well inside a kernel call that holds the GIL (it could only run before the call or
    after it), and many do when the call releases it."""
    import threading
    import time

    x = torch.randn(512, 2048)
    w = torch.randn(2048, 2048)
    packed = cpu_kernels.pack_rows(w)
    stamps: list[float] = []
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())

    for call in (lambda: cpu_kernels.rows_linear(x, w, None), lambda: cpu_kernels.packed_linear(x, packed, 2048, None)):
        call()  # warm
        stamps.clear()
        done.clear()
        thread = threading.Thread(target=spin)
        thread.start()
        while not stamps:
            time.sleep(0.001)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        done.set()
        thread.join()
        margin = 0.01 + (t1 - t0) * 0.1  # the GIL switch interval is 5 ms
        assert t1 - t0 > 3 * margin, f"the call took {t1 - t0:.3f} s: too short to tell"
        inside = [s for s in stamps if t0 + margin < s < t1 - margin]
        assert len(inside) > 100, f"{len(inside)} Python steps ran during a {t1 - t0:.3f} s kernel call"


def test_packed_weights_and_kv_caches_live_on_one_huge_page_buffer(tmp_path, monkeypatch):
    """`on_huge_pages` copies tensors bit for bit into one buffer whose region is 2 MiB-aligned
    and marked MADV_HUGEPAGE (checked through a recording madvise); the engine puts every packed
    matrix of the target there, and its CPU KV caches in another; SPECDECODE_HUGE_PAGES=0 marks
    nothing."""
    from helpers import save_tiny_model

    from engine import LLMEngine

    calls = []
    real = cpu_kernels._libc()

    class Recorder:
        def madvise(self, addr, length, advice):
            calls.append((addr, length, advice))
            return real.madvise(addr, length, advice)

    monkeypatch.setattr(cpu_kernels, "_libc", lambda: Recorder())
    ts = [torch.randn(5, 7), torch.randn(3, 130).to(torch.bfloat16), torch.arange(9)]
    moved = cpu_kernels.on_huge_pages(ts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, moved, strict=True))
    assert len({m.untyped_storage().data_ptr() for m in moved}) == 1
    (addr, length, advice), = calls
    assert addr % (2 << 20) == 0 and length % (2 << 20) == 0 and advice == cpu_kernels.MADV_HUGEPAGE
    assert all(addr <= m.data_ptr() < addr + length for m in moved)

    calls.clear()
    engine = LLMEngine(save_tiny_model(str(tmp_path / "m"), "llama"), dtype="float32", device="cpu")
    model = engine.runner.model
    mats = [layer.row_weights()[k] for layer in model.layers for k in ("w_qkv", "w_o", "w_gate_up", "w_down")]
    mats.append(model.packed_lm_head())
    assert len({m.untyped_storage().data_ptr() for m in mats}) == 1
    caches = [c for kv in engine.runner.kv_caches for c in kv]
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1 and all(c.is_contiguous() for c in caches)
    marked = [(a, n) for a, n, _ in calls]
    for t in (mats[0], caches[0]):
        assert any(a <= t.data_ptr() < a + n for a, n in marked)

    calls.clear()
    monkeypatch.setenv(cpu_kernels.ENV_HUGE_PAGES, "0")
    cpu_kernels.on_huge_pages(ts)
    assert calls == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_tokens_is_the_stack_with_the_torch_ends(tmp_path, dtype):
    """`RowsStack.forward_tokens` (embedding, rope rows, layers, final norm and the model's dtype
    in one call) against the same stack's `forward` with those ends in torch ops: the auxiliary
    features (EAGLE-3's) bit for bit, the hidden rows within the final norm's rounding (the
    kernel's sum of squares runs in another order than torch's), the greedy tokens equal; bad
    token ids and positions are refused."""
    from helpers import save_tiny_model

    from engine.model_runner import ModelRunner, SeqChunk

    path = save_tiny_model(str(tmp_path / "m"), "llama")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    prompt, tokens = list(range(3, 40)), [41, 7, 19, 23]
    out = {}
    for fused in (True, False):
        r = ModelRunner(path, torch.device("cpu"), dt, 256, "torch", "rows")
        r.model.aux_layer_ids = (0, 1, r.model.cfg.num_layers)
        r.model.fused_ends = fused
        r.init_kv_cache(16, 16)
        with torch.inference_mode():
            r.forward([SeqChunk(prompt, 0, [0, 1, 2])])
            chunks = [SeqChunk(tokens, len(prompt), [0, 1, 2])]
            _, h = r.forward(chunks)
            out[fused] = (h, r.model.aux_hidden_states, r.logits(h, r.tile_rows(chunks)).argmax(-1))
    (h, aux, tok), (h_ref, aux_ref, tok_ref) = out[True], out[False]
    assert h.dtype == h_ref.dtype == aux.dtype == aux_ref.dtype == dt
    assert aux.shape == (len(tokens), 3 * r.model.cfg.hidden_size)
    assert torch.equal(aux, aux_ref)
    ulp = {"float32": 1e-5, "bfloat16": 2 ** -7}[dtype]
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=ulp, atol=ulp)
    assert torch.equal(tok, tok_ref)
    stack = r.model.rows_stack(r.kv_caches)
    slots, tables, lens = torch.tensor([40]), torch.tensor([[0, 1, 2]]), torch.tensor([41])
    with pytest.raises(RuntimeError, match="token id 9999 out of range"):
        stack.forward_tokens(torch.tensor([9999]), torch.tensor([40]), slots, tables, lens, False, NO_TREE)
    with pytest.raises(RuntimeError, match="beyond the rope table"):
        stack.forward_tokens(torch.tensor([5]), torch.tensor([10**6]), slots, tables, lens, False, NO_TREE)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_is_packed_linear_over_those_rows(xdtype):
    """The LM head over the rows that sample, in one call: the same bits as indexing, widening and
    `packed_linear`; a row out of range is refused."""
    torch.manual_seed(0)
    x = torch.randn(7, 96).to(xdtype)
    packed = pack(torch.randn(50, 96).to(torch.bfloat16), "plain")
    rows = [6, 0, 3, 3]
    got = cpu_kernels.packed_linear_rows(x, rows, packed, 50)
    assert got.dtype == torch.float32 and got.shape == (4, 50)
    assert torch.equal(got, cpu_kernels.packed_linear(x[torch.tensor(rows)].float(), packed, 50, None))
    with pytest.raises(RuntimeError, match="row 7 out of range"):
        cpu_kernels.packed_linear_rows(x, [7], packed, 50)


NO_DOT_BF16 = not cpu_kernels.available() or not cpu_kernels.prefill_attention_available()


def _paged(seq_lens, bs, hkv, d, g):
    """Random bfloat16 caches and shuffled block tables [B, max_blocks] holding seq_lens positions."""
    nblocks = sum(-(-s // bs) for s in seq_lens) + 3
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(-(-s // bs) for s in seq_lens)
    tables, o = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[o : o + n] + [0] * (width - n))
        o += n
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int64)


def _prefill_reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale):
    """Causal attention from its definition in float64 over the same bfloat16 inputs, with the
    probabilities rounded to bfloat16 before the product with v (as the kernel and torch's flash
    attention compute bfloat16), normalized by the sum of the unrounded ones."""
    _, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, s in enumerate(seq_lens.tolist()):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        pos = torch.arange(s)
        slots = tables[b][pos // bs] * bs + pos % bs
        k = k_cache.view(-1, hkv, d)[slots].double().repeat_interleave(h // hkv, 1)  # [S, H, D]
        v = v_cache.view(-1, hkv, d)[slots].double().repeat_interleave(h // hkv, 1)
        scores = torch.einsum("thd,shd->hts", q[lo:hi].double(), k) * scale
        qpos = torch.arange(s - (hi - lo), s)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        p = e.bfloat16().double()  # (exp(-inf) = 0 stays 0)
        out[lo:hi] = torch.einsum("hts,shd->thd", p, v) / e.sum(-1).transpose(0, 1)[..., None]
    return out


@pytest.mark.skipif(NO_DOT_BF16, reason="prefill_attention needs AVX512-BF16")
@pytest.mark.parametrize(("hkv", "group", "d", "bs"), [(4, 2, 64, 16), (2, 4, 32, 1), (1, 8, 128, 16), (3, 1, 48, 5),
                                                       (2, 2, 256, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_matches_its_definition_and_is_row_invariant(hkv, group, d, bs, threads):
    """cpu_kernels.prefill_attention against causal attention written from its definition
    (several requests in one call, prefix context before some chunks, GQA, head sizes 32-256,
    block sizes 1, 5 and 16, odd and even context lengths): within two bfloat16 ulps. And a
    token's result is bit-identical whether its request is alone in the call or next to others,
    and whether its prompt is computed in one chunk or in two (the second over the first's cache)."""
    g = torch.Generator().manual_seed(d + bs)
    h = hkv * group
    q_lens, ctx = [37, 1, 70, 16], [0, 20, 33, 1]
    seq_lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    k_cache, v_cache, tables = _paged(seq_lens, bs, hkv, d, g)
    q = torch.randn(sum(q_lens), h, d, generator=g).bfloat16()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    seqs = torch.tensor(seq_lens, dtype=torch.int64)
    scale = d**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.prefill_attention(q, k_cache, v_cache, qsl, seqs, tables, scale)
        ref = _prefill_reference(q, k_cache, v_cache, qsl, seqs, tables, scale)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        torch.testing.assert_close(out.double(), ref, rtol=2 * 2.0**-8, atol=2.0**-12)
        lo = int(qsl[2])
        alone = cpu_kernels.prefill_attention(q[lo : lo + 70], k_cache, v_cache, torch.tensor([0, 70]),
                                              seqs[2:3], tables[2:3], scale)
        assert torch.equal(alone, out[lo : lo + 70])
        first = cpu_kernels.prefill_attention(q[lo : lo + 29], k_cache, v_cache, torch.tensor([0, 29]),
                                              torch.tensor([ctx[2] + 29]), tables[2:3], scale)
        rest = cpu_kernels.prefill_attention(q[lo + 29 : lo + 70], k_cache, v_cache, torch.tensor([0, 41]),
                                             seqs[2:3], tables[2:3], scale)
        assert torch.equal(torch.cat([first, rest]), alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(NO_DOT_BF16, reason="prefill_attention needs AVX512-BF16")
def test_prefill_attention_serves_long_bfloat16_chunks_of_the_torch_backend(monkeypatch):
    """The torch backend sends a group with a chunk of >= PREFILL_KERNEL_MIN_QUERY tokens to
    prefill_attention when the model is bfloat16 (and SDPA otherwise: float32, short queries, tree
    masks); both give the same attention to bfloat16 precision. Bad input is refused."""
    from kernels import torch_attn

    g = torch.Generator().manual_seed(0)
    bs, hkv, d = 16, 4, 64
    q_lens, seq_lens = [40, 1, 1], [100, 57, 3]
    k_cache, v_cache, tables = _paged(seq_lens, bs, hkv, d, g)
    slots = [int(tables[b][p // bs]) * bs + p % bs for b, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True))
             for p in range(s - n, s)]
    backend = torch_attn.TorchAttentionBackend()
    md = backend.build_metadata(q_lens, seq_lens, tables.tolist(), slots, bs, torch.device("cpu"))
    q = torch.randn(sum(q_lens), 8, d, generator=g).bfloat16()
    calls = []
    real = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    out = backend.attention(q, k_cache, v_cache, md, 0.125)
    assert calls == [40]  # the 40-token chunk's group; the two decode tokens' group took SDPA
    monkeypatch.setattr(torch_attn, "PREFILL_KERNEL_MIN_QUERY", 10**6)
    md_sdpa = backend.build_metadata(q_lens, seq_lens, tables.tolist(), slots, bs, torch.device("cpu"))
    sdpa = backend.attention(q, k_cache, v_cache, md_sdpa, 0.125)
    assert calls == [40]
    torch.testing.assert_close(out.float(), sdpa.float(), rtol=2 * 2.0**-8, atol=2.0**-10)
    backend.attention(q.float(), k_cache.float(), v_cache.float(), md, 0.125)  # float32: SDPA
    assert calls == [40]
    m = cpu_kernels._module()
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        m.prefill_attention(q.float(), k_cache, v_cache, torch.tensor([0, 42]), torch.tensor([100]), tables[:1], 0.1)
    with pytest.raises(RuntimeError, match="q_len <= seq_len"):
        m.prefill_attention(q[:42], k_cache, v_cache, torch.tensor([0, 42]), torch.tensor([30]), tables[:1], 0.1)
    with pytest.raises(RuntimeError, match="ctx_lens out of range"):
        m.prefill_attention(q[:42], k_cache, v_cache, torch.tensor([0, 42]), torch.tensor([10_000]), tables[:1], 0.1)
