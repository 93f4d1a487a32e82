// Weight packing (pack_rows, pack_rows_int8, pack_rows_int4) and the products y = x @ w.T (+ b)
// over packed weights, one kernel per layout (the GGUF block layouts' in gguf_products.cpp): linear_packed (AVX2 + FMA, float32 or bfloat16
// widened), linear_dp (AVX512-BF16) and linear_amx (AMX tiles) over the same dp layout, linear_i8
// and linear_i4 (AVX512-VNNI, drafters). Each keeps cpu_kernels.h's row exactness.
#include "cpu_kernels.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace cpu_kernels {
namespace {

// ---- the matmul: packed weights, a fixed order per output ------------------------------------
// Weights are packed (pack_rows) in blocks of 4 rows stored in the order the kernel reads them:
// for each 8-wide step of K, the 8 weights of row 0, then of rows 1, 2, 3 (32 values; bfloat16:
// rows 0 and 1 interleaved, then rows 2 and 3, see pack_block); then the scalar tail K % 8 as
// 4 x (K % 8) (rows past N are zeros). A product is then one sequential
// stream, which the hardware prefetcher follows far better than four rows K apart.
//
// The order of every output y[m, n] = x[m] . w[n]: one 8-lane float32 accumulator over K in steps
// of 8 (FMA), a fixed horizontal sum, then the scalar tail in k order. It depends on K only, never
// on M, on which rows of x are computed together, on the weight rows blocked with it or on the
// thread: a token's outputs are the same bits alone (a one-token decode step) or next to others
// (a verification of k drafts, other requests). bfloat16 weights are widened in registers (a
// 16-bit shift, exact). One row streams the weights from memory; more rows are taken three (then
// two, one) at a time against each weight load, the block staying in L1 between the groups, so an
// extra row costs its FMAs only.
constexpr int PACK = 4;

template <typename W>
void pack_block(const W* w, int64_t nb, int64_t K, W* dst) {
  int64_t k = 0, o = 0;
  auto at = [&](int64_t j, int64_t kk) { return j < nb ? w[j * K + kk] : W(0); };
  auto put = [&](int64_t width) {
    for (int64_t j = 0; j < PACK; ++j) {
      for (int64_t i = 0; i < width; ++i) dst[o++] = at(j, k + i);
    }
    k += width;
  };
  // bfloat16: each 8-wide step stores rows (0, 1) interleaved, then rows (2, 3): one 256-bit load
  // then widens to both rows' 8 floats with one shift (even halves) and one mask (odd halves)
  // instead of a zero-extension and a shift per row.
  auto put_pairs = [&]() {
    for (int64_t j = 0; j < PACK; j += 2) {
      for (int64_t i = 0; i < 8; ++i) {
        dst[o++] = at(j, k + i);
        dst[o++] = at(j + 1, k + i);
      }
    }
    k += 8;
  };
  while (k + 8 <= K) {
    if constexpr (std::is_same_v<W, uint16_t>) put_pairs();
    else put(8);
  }
  if (k < K) put(K - k);
}

// MB rows of x against the 4 weight rows of one packed block: out[m][j] = x[m] . w[j].
template <int MB, typename W>
inline void dots_packed(const float* const* x, const W* p, int64_t K, float (*out)[PACK], bool prefetch) {
  // prefetch: PF bytes ahead in the stream into L2, every cache line of it, as linear_dp does
  // (linear_packed asks for it where it helps: bfloat16 weights, float32 ones from 4 rows; a lone
  // float32 row streams faster without it)
  constexpr int64_t PF = 6144, STEP = 8 * PACK * sizeof(W);
  __m256 acc[MB][PACK];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < PACK; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8, p += 8 * PACK) {
    if (prefetch) {
      for (int64_t o = 0; o < STEP; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + PF + o, _MM_HINT_T1);
    }
    if constexpr (std::is_same_v<W, uint16_t>) {
      const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int j = 0; j < PACK; j += 2) {  // rows j, j + 1 interleaved (pack_block)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * j));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[m] + k), w0, acc[m][j]);
        const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        for (int m = 0; m < MB; ++m) acc[m][j + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x[m] + k), w1, acc[m][j + 1]);
      }
    } else {
      __m256 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x[m] + k);
      for (int j = 0; j < PACK; ++j) {
        const __m256 w = load8(p + 8 * j);
        for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(xv[m], w, acc[m][j]);
      }
    }
  }
  const int64_t tail = K - k;
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < PACK; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t t = 0; t < tail; ++t) s += x[m][k + t] * load1(p + j * tail + t);
      out[m][j] = s;
    }
  }
}

// y[m, :N] = x[m] @ w.T (+ b), w packed, for M rows of x.
// y[m + i, n0 + j] = out[i][j] (+ b) for `rows` rows and nb columns.
template <int64_t BW = PACK>
inline void store_block(float* y, int64_t N, int64_t m, int rows, int64_t n0, int64_t nb, const float (*out)[BW],
                        const float* bias) {
  for (int i = 0; i < rows; ++i)
    for (int64_t j = 0; j < nb; ++j) y[(m + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
}

template <typename W>
void linear_packed(const float* x, int64_t M, int64_t K, const W* wp, int64_t N, const float* bias, float* y,
                   int threads) {
  over_tiles_and_blocks<PACK>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
    const W* p = wp + blk * PACK * K;
    float out[3][PACK];
    // the first tile prefetches (bfloat16 always, float32 from 4 rows)
    const bool pf = sizeof(W) == 2 || m1 - m0 >= 4;
    int64_t m = m0;
    for (; m + 3 <= m1; m += 3) {
      const float* xs[3] = {x + m * K, x + (m + 1) * K, x + (m + 2) * K};
      dots_packed<3>(xs, p, K, out, pf && m == m0);
      store_block(y, N, m, 3, n0, nb, out, bias);
    }
    if (m1 - m == 2) {
      const float* xs[2] = {x + m * K, x + (m + 1) * K};
      dots_packed<2>(xs, p, K, out, pf && m == m0);
      store_block(y, N, m, 2, n0, nb, out, bias);
    } else if (m1 - m == 1) {
      const float* xs[1] = {x + m * K};
      dots_packed<1>(xs, p, K, out, pf && m == m0);
      store_block(y, N, m, 1, n0, nb, out, bias);
    }
  });
}

// ---- bfloat16 products by dot-product instructions (AVX512-BF16) ---------------------------
// On CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later) a bfloat16 product can
// run as `vdpbf16ps`: 32 bfloat16 pairs multiplied and summed into 16 float32 lanes per
// instruction, twice the multiply-adds of the widen-then-FMA path above, which is what a step of
// several rows (a verification, a batch) is bound by. The activations are rounded to bfloat16
// first (round to nearest even, as torch's `.to(torch.bfloat16)`), as a bfloat16 model's
// products take them in torch; the weights are packed in their own layout (pack_block_dp), told
// apart from the other by its shape ([ceil(N / 64), 64 * K2] instead of [ceil(N / 4) * 4, K]).
//
// The layout is "vertical": a block holds 64 outputs, and for each pair of k (2s, 2s + 1) the
// pairs of its 64 weight rows side by side (4 registers, 256 bytes of the stream). A register's 16
// lanes are 16 outputs: the pair (x[2s], x[2s + 1]) of a row of x is broadcast to every lane and
// one `vdpbf16ps` adds its products to 16 outputs at once, so a sum never needs a horizontal
// reduction.
//
// The order of every output y[m, n] = bf16(x[m]) . w[n]: one float32 lane accumulating the pairs
// (2s, 2s + 1) in k order, one `vdpbf16ps` per pair (K zero-padded to K2, even: a padded pair adds
// exact zeros). It depends on K only: the same bits alone or next to other rows, as for the path
// above (not the same bits as that path: the activations are rounded, and the sums run in
// another order).
constexpr int64_t KB = 32;  // bfloat16 values per 512-bit register
inline int64_t k32(int64_t K) { return (K + KB - 1) / KB * KB; }
inline int64_t k2(int64_t K) { return (K + 1) / 2 * 2; }

// Rows nb (<= 64) of w [nb, K] -> for each pair (2s, 2s + 1) of K, that pair of rows 0 .. 63 in
// row order (zeros past K and for rows past N): one 256-byte stretch of the stream per pair.
void pack_block_dp(const uint16_t* w, int64_t nb, int64_t K, uint16_t* dst) {
  int64_t o = 0;
  for (int64_t k = 0; k < k2(K); k += 2)
    for (int64_t j = 0; j < VN; ++j)
      for (int64_t i = 0; i < 2; ++i) dst[o++] = (j < nb && k + i < K) ? w[j * K + k + i] : uint16_t(0);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

// float32 row [K] -> bfloat16 [K32], round to nearest even (NaN -> 0x7fc0, as f32_to_bf16 and
// torch), zeros past K.
__attribute__((noinline)) void round_row_bf16(const float* x, int64_t K, uint16_t* out) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x7fc0);
  for (int64_t k = 0; k < k32(K); k += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, K - k));
    const __mmask16 live = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + std::min(k, K));
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtepi32_epi16(r));
  }
}

// MB rows of bfloat16 x [K2] (stride irrelevant) against the 64 weight rows of one dp-packed
// block: out[m][n] = x[m] . w[n].
// In a tile of at least DP_PREFETCH_ROWS rows, the weights a block's first group of rows reads
// DP_PREFETCH bytes ahead of it are prefetched into L2: the hardware prefetcher runs only a short
// way ahead of the demand stream and would leave the memory idle while such a step computes (a
// step's weights, 80 MB, come cold from DRAM); smaller steps stream as fast without it, or faster.
constexpr int64_t DP_PREFETCH = 6144, DP_PREFETCH_ROWS = 6;

template <int MB>
__attribute__((noinline)) void dots_dp(const uint16_t* const* x, const uint16_t* p, int64_t s0, int64_t s1,
                                       float (*out)[VN], bool init, int64_t pf_ahead, unsigned pf_lines) {
  __m512 acc[MB][VZ];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) acc[m][j] = init ? _mm512_setzero_ps() : _mm512_load_ps(out[m] + 16 * j);
  p += s0 * 2 * VN;
  for (int64_t s = s0; s < s1; ++s, p += 2 * VN) {
    if (pf_lines) {  // (no fault past the end)
      const char* ahead = reinterpret_cast<const char*>(p) + pf_ahead;
      for (int l = 0; l < 2 * VN * 2 / 64; ++l)
        if (pf_lines >> l & 1u) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    }
    __m512bh w[VZ];
    for (int j = 0; j < VZ; ++j) w[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x[m] + 2 * s, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < VZ; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) _mm512_store_ps(out[m] + 16 * j, acc[m][j]);
}

#pragma GCC pop_options

// Up to 6 rows per weight load (24 accumulators, 4 weight registers and one of x: 29 of the
// 32 registers).
constexpr int DP_ROWS = 6;

// Rows x[0 .. rows) (<= DP_ROWS) over the pairs [s0, s1) of a block: out[m] += their dot products
// (out[m] = them when `init`); out 64-byte aligned. Each pair prefetches the cache lines of its
// 256-byte stretch set in pf_lines (bit l: line l), pf_ahead bytes ahead, into L2.
void dots_dp_rows(int rows, const uint16_t* const* x, const uint16_t* p, int64_t s0, int64_t s1, float (*out)[VN],
                  bool init, int64_t pf_ahead, unsigned pf_lines) {
  switch (rows) {
    case 6: dots_dp<6>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
    case 5: dots_dp<5>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
    case 4: dots_dp<4>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
    case 3: dots_dp<3>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
    case 2: dots_dp<2>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
    default: dots_dp<1>(x, p, s0, s1, out, init, pf_ahead, pf_lines); break;
  }
}

// A block's pairs per chunk when a tile has more rows than one pass takes (16 KB of weights, which
// stay in L1 while every group of rows runs over them).
constexpr int64_t DP_CHUNK = 64, DP_CHUNKED_GROUPS = 3;

// ---- bfloat16 products on AMX tiles (Sapphire Rapids and later) ------------------------------
// Where the CPU has AMX-BF16 (and Linux grants the tile state), the dp-packed products run as
// `tdpbf16ps` on tiles instead: the dp layout is already AMX's B-tile layout (a pair of k for 16
// outputs is one 64-byte tile row; a block's pairs lie 256 bytes apart, the tile's stride), so the
// same packed weights serve both. A tile op multiplies up to 16 rows of x by 16 pairs of k for 16
// outputs (8x the multiply-adds per instruction of `vdpbf16ps` at 16 rows): a step of 1-16 rows
// then costs about what one row does, the weight stream, where `vdpbf16ps` is bound by the
// multiply-adds from a few rows.
// The order of every output: one float32 accumulator tile over k in chunks of 16 pairs (32 k),
// each chunk's 32 products added by the tile op in the hardware's own order. A row's outputs
// depend on its own x row and the weights only: the same bits alone, with 16 rows or with padding
// rows (tested), but not `vdpbf16ps`'s bits (another order of additions). A product takes this
// path where amx_products() is on and its pairs are a multiple of 16 (K % 32 == 0 after the
// pairing: every product of the shipped models), whatever its number of rows, so a one-token step
// and a verification still agree bit for bit; other K keep the `vdpbf16ps` path, also for every M.

// Whether dp-packed products run on AMX where the CPU has it (default on; SPECDECODE_CPU_AMX=0
// turns it off at load, tests to compare). Switching it changes the products' bits: the engine
// never switches while it runs.
static bool g_amx = true;

}  // namespace

bool amx_products() { return g_amx && cpu_has_amx_bf16(); }

bool set_amx(bool on) {
  const bool before = g_amx;
  g_amx = on;
  return before;
}

namespace {

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

// Tiles 0-3: the sums of `rows` rows x 16 outputs (float32); 4: `rows` rows of x, 16 pairs of k;
// 5-7: 16 pairs of k x 16 outputs of the weights.
static void amx_configure(int rows) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 5; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  for (int t = 5; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  __asm__ volatile("" : : "r"(&c) : "memory");  // (the stores are read by ldtilecfg, which GCC may not see)
  _tile_loadconfig(&c);
}

// The configured rows of bfloat16 x (row stride xs bytes) against one dp-packed block (64 outputs,
// KP pairs, KP % 16 == 0): out[m][n] = x[m] . w[n]. The block's weights are read as 16-pair
// chunks of 4 KB, in stream order; each chunk's four tiles of 16 outputs rotate over three tile
// registers, so a load never waits for the product that read its register last.
static void block_amx(const uint16_t* x, int64_t xs, const uint16_t* p, int64_t KP, float (*out)[VN]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < KP; s += 16) {
    const char* b = reinterpret_cast<const char*>(p + s * 2 * VN);
    _tile_loadd(4, x + 2 * s, xs);
    _tile_loadd(5, b, 2 * VN * 2);
    _tile_loadd(6, b + 64, 2 * VN * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, b + 128, 2 * VN * 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 192, 2 * VN * 2);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, &out[0][0], VN * 4);
  _tile_stored(1, &out[0][16], VN * 4);
  _tile_stored(2, &out[0][32], VN * 4);
  _tile_stored(3, &out[0][48], VN * 4);
}

// y = xb @ w.T (+ b) on tiles: xb [M, K32] bfloat16 (rows rounded by linear_dp), w dp-packed.
// Up to 16 rows are one tile of that many rows; more run as tiles of 16 over each block in turn
// (the block, 64 x K weights, stays in L2 between them), the last one padded with zero rows.
static void linear_amx(const uint16_t* xb, int64_t M, int64_t K32, const uint16_t* wp, int64_t N, int64_t KP,
                       const float* bias, float* y, int threads) {
  const int64_t blocks = (N + VN - 1) / VN, tile_rows = std::min<int64_t>(M, 16), tiles = (M + 15) / 16;
  std::vector<uint16_t> padded;
  if (M > 16 && M % 16 != 0) {
    padded.assign(tiles * 16 * K32, 0);
    std::memcpy(padded.data(), xb, sizeof(uint16_t) * M * K32);
    xb = padded.data();
  }
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
  {
    amx_configure(static_cast<int>(tile_rows));
    alignas(64) float out[16][VN];
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * VN, nb = std::min<int64_t>(VN, N - n0);
      for (int64_t t = 0; t < tiles; ++t) {
        block_amx(xb + t * 16 * K32, K32 * 2, wp + blk * VN * 2 * KP, KP, out);
        store_block<VN>(y, N, t * 16, static_cast<int>(std::min<int64_t>(16, M - t * 16)), n0, nb, out, bias);
      }
    }
    _tile_release();
  }
}

#pragma GCC pop_options

// y[m, :N] = bf16(x[m]) @ w.T (+ b), w dp-packed, for M rows of x (tiles of M_TILE rows).
// A tile of up to DP_ROWS rows runs over each block in one pass, prefetching its weights ahead.
// One of 7-18 rows (a verification of 6-17 drafts, a few requests) splits into 2-3 groups as
// even as possible (7 rows: 3 + 4) that take turns over each chunk of DP_CHUNK pairs (16 KB,
// read again from L1), their sums kept in `out` between chunks, every group prefetching its share
// of the next chunk's lines, so the memory streams while each group computes (were the groups to
// run over the whole block in turn, the memory would idle while the later ones re-read it from
// L2). Larger tiles (prefill, batches) run each group over the whole block in turn: their groups
// are bound by the multiply-adds, and chunking would slow them down.
// The sums are the same either way: each output's lane adds its pairs in k order, whichever
// rows run next to it, and a chunk's sums go to memory and back unchanged.
void linear_dp(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, const float* bias, float* y,
               int threads) {
  const int64_t K32 = k32(K), K2 = k2(K), KP = K2 / 2;
  std::vector<uint16_t> xb(M * K32);
  for (int64_t m = 0; m < M; ++m) round_row_bf16(x + m * K, K, xb.data() + m * K32);
  if (KP % 16 == 0 && amx_products()) return linear_amx(xb.data(), M, K32, wp, N, KP, bias, y, threads);
  over_tiles_and_blocks<VN>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
    const uint16_t* p = wp + blk * VN * K2;
    alignas(64) float out[M_TILE][VN];
    const int64_t rows = m1 - m0, groups = (rows + DP_ROWS - 1) / DP_ROWS;
    const uint16_t* xs[M_TILE];
    for (int64_t i = 0; i < rows; ++i) xs[i] = xb.data() + (m0 + i) * K32;
    const bool prefetch = rows >= DP_PREFETCH_ROWS;
    if (groups == 1 || groups > DP_CHUNKED_GROUPS) {  // each group over the whole block in turn
      for (int64_t g = 0, r0 = 0; g < groups; ++g) {
        const int64_t n = std::min<int64_t>(DP_ROWS, rows - r0);
        dots_dp_rows(static_cast<int>(n), xs + r0, p, 0, KP, out + r0, true, DP_PREFETCH, prefetch && g == 0 ? 0xFu : 0u);
        r0 += n;
      }
    } else {
      // the groups share the prefetching of the next chunk's lines (the next block's first chunk
      // after the last: the blocks lie one after another), so the memory streams all along
      for (int64_t s0 = 0; s0 < KP; s0 += DP_CHUNK) {
        const int64_t s1 = std::min(KP, s0 + DP_CHUNK);
        for (int64_t g = 0, r0 = 0; g < groups; ++g) {
          const int64_t n = (rows - r0) / (groups - g);  // the rows left, spread over the groups left
          unsigned lines = 0;
          for (int l = 0; l < 4; ++l) lines |= (l % groups == g ? 1u : 0u) << l;
          dots_dp_rows(static_cast<int>(n), xs + r0, p, s0, s1, out + r0, s0 == 0, DP_CHUNK * 2 * VN * 2, lines);
          r0 += n;
        }
      }
    }
    store_block<VN>(y, N, m0, static_cast<int>(rows), n0, nb, out, bias);
  });
}

// ---- int8 weights, 16-bit activations (AVX512-VNNI): a drafter's products ------------------
// A drafter's weights are read whole for every draft, one row at a time, from L3 (an EAGLE-3
// head of 512 x 2048: 7.9 MB in bfloat16, past the 2 MB of L2), so a draft costs its weight
// bytes. Packed as int8 with one float32 scale per output row (max |w| / 127, round to nearest),
// they are half the bytes. The activations of each row are quantized to 16-bit integers with one
// scale per row (max |x| / A, A the largest magnitude whose K products of 127 cannot overflow an
// int32: A = min(32767, (2^31 - 1) / (127 * K2))), and `vpdpwssd` adds the products of a pair of k
// for 16 outputs in int32, exactly; y[m, n] = float(sum) * (scale_x[m] * scale_w[n]) (+ b[n]).
// The sums are integers, so every row's outputs are the same bits whatever rows run next to it.
// Lossy (the drafter's logits move by ~1e-3 of their scale): for drafters only, whose drafts the
// target verifies; the target's products never take this layout.
// Layout: blocks of 64 outputs as the dp layout (for each pair of k, the block's 64 rows' pairs of
// int8 side by side: 128 bytes), then the block's 64 float32 scales: [ceil(N / 64), 64 * K2 + 256]
// int8.
constexpr int64_t I8_TAIL = VN * 4;  // a block's scales, in bytes

inline int64_t i8_row_bytes(int64_t K) { return VN * k2(K) + I8_TAIL; }

template <typename W>
void pack_block_i8(const W* w, int64_t nb, int64_t K, int8_t* dst) {
  const int64_t K2 = k2(K);
  std::memset(dst, 0, VN * K2 + I8_TAIL);
  float* scales = reinterpret_cast<float*>(dst + VN * K2);
  for (int64_t r = 0; r < nb; ++r) {
    float mx = 0.0f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(load1(w + r * K + k)));
    const float sc = mx > 0.0f ? mx / 127.0f : 0.0f;
    scales[r] = sc;
    for (int64_t k = 0; k < K; ++k) {
      const float q = sc > 0.0f ? std::nearbyint(load1(w + r * K + k) / sc) : 0.0f;
      dst[((k / 2) * VN + r) * 2 + k % 2] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// MB rows of int16 x [K2] against one int8 block: acc[m][n] = sum over pairs, int32.
template <int MB>
__attribute__((noinline)) void dots_i8(const int16_t* const* x, const int8_t* p, int64_t KP, int32_t (*acc)[VN]) {
  __m512i a[MB][VZ];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) a[m][j] = _mm512_setzero_si512();
  for (int64_t s = 0; s < KP; ++s, p += 2 * VN) {
    __m512i w[VZ];
    for (int j = 0; j < VZ; ++j)
      w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x[m] + 2 * s, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int j = 0; j < VZ; ++j) a[m][j] = _mm512_dpwssd_epi32(a[m][j], xv, w[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) _mm512_storeu_si512(acc[m] + 16 * j, a[m][j]);
}

#pragma GCC pop_options

void dots_i8_rows(int rows, const int16_t* const* x, const int8_t* p, int64_t KP, int32_t (*acc)[VN]) {
  switch (rows) {
    case 6: dots_i8<6>(x, p, KP, acc); break;
    case 5: dots_i8<5>(x, p, KP, acc); break;
    case 4: dots_i8<4>(x, p, KP, acc); break;
    case 3: dots_i8<3>(x, p, KP, acc); break;
    case 2: dots_i8<2>(x, p, KP, acc); break;
    default: dots_i8<1>(x, p, KP, acc); break;
  }
}

// y[m, :N] = x[m] @ w.T (+ b), w int8-packed, for M rows of x (tiles of M_TILE rows, groups of
// up to 6 rows over each block in turn).
void linear_i8(const float* x, int64_t M, int64_t K, const int8_t* wp, int64_t N, const float* bias, float* y,
               int threads) {
  const int64_t K2 = k2(K), KP = K2 / 2, row_bytes = i8_row_bytes(K);
  const float A = std::min(32767.0f, std::floor(2147483647.0f / (127.0f * static_cast<float>(K2))));
  std::vector<int16_t> xq(M * K2, 0);
  std::vector<float> xs(M);
  for (int64_t m = 0; m < M; ++m) {
    float mx = 0.0f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(x[m * K + k]));
    xs[m] = mx > 0.0f ? mx / A : 0.0f;
    if (mx > 0.0f)
      for (int64_t k = 0; k < K; ++k) xq[m * K2 + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] / xs[m]));
  }
  over_tiles_and_blocks<VN>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
    const int8_t* p = wp + blk * row_bytes;
    const float* ws = reinterpret_cast<const float*>(p + VN * K2);
    alignas(64) int32_t acc[DP_ROWS][VN];
    for (int64_t r0 = m0; r0 < m1; r0 += DP_ROWS) {
      const int64_t n = std::min<int64_t>(DP_ROWS, m1 - r0);
      const int16_t* rows[DP_ROWS];
      for (int64_t i = 0; i < n; ++i) rows[i] = xq.data() + (r0 + i) * K2;
      dots_i8_rows(static_cast<int>(n), rows, p, KP, acc);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < nb; ++j)
          y[(r0 + i) * N + n0 + j] = static_cast<float>(acc[i][j]) * (xs[r0 + i] * ws[j]) + (bias ? bias[n0 + j] : 0.0f);
    }
  });
}

// ---- int4 weights, 16-bit activations (AVX512-VNNI): a drafter's products at a quarter of
// bfloat16's bytes ---------------------------------------------------------------------------
// linear_i8's scheme with 4-bit weights and a scale per group of 32 k of each output row: a draft
// reads half of int8's bytes (an EAGLE-3 head's draft: 3.75 MB as int8, 2.1 MB as int4), and
// the drafts of a chain are bound by those bytes (cold from L3 after each target forward). Each
// weight w = s * q, q in [-7, 7] the nearest integer to w / s, s = max |w| / 7 over its group
// (s rounded to bfloat16 first, so q uses the scale the kernel reads); groups of 32 keep the
// shipped head's acceptance, which one scale per row would lower (bench/eval in the model card).
// Stored as q + 8 in [1, 15], a nibble. The activations of a row are int16 with one scale per row
// (max |x| / 32767); per group, `vpdpwssd` adds x * (q + 8) in int32, exactly, and the group's sum
// of x times 8 is taken off (exact: |sum| <= 32 * 7 * 32767 < 2^24, so its float is exact too);
// then y += float(group sum) * s in float32, group by group in k order, and y * scale_x (+ b).
// Every output's operations depend on its own row of x and the weights only: the same bits alone
// or next to other rows. Layout per block of 64 outputs, K a multiple of 32: for each pair of k
// (k, k + 1), 64 bytes: byte b < 32 holds (low nibble) row b / 2 and (high) row 16 + b / 2,
// byte 32 + b rows 32 + b / 2 and 48 + b / 2, k + b % 2 (vpmovzxbw, an and and a shift make the
// four registers of 16 rows' pairs linear_i8 reads); then per group of 32 k the 64 rows'
// scales as bfloat16: [ceil(N / 64), 36 * K] uint8. Rows past N are zeros (q = 0, s = 0).
constexpr int64_t I4_GROUP = 32;

inline int64_t i4_row_bytes(int64_t K) { return 32 * K + VN * 2 * (K / I4_GROUP); }

template <typename W>
void pack_block_i4(const W* w, int64_t nb, int64_t K, uint8_t* dst) {
  const int64_t KP = K / 2, KG = K / I4_GROUP;
  std::memset(dst, 0x88, 64 * KP);  // q = 0 everywhere (rows past nb)
  uint16_t* scales = reinterpret_cast<uint16_t*>(dst + 64 * KP);
  std::memset(scales, 0, sizeof(uint16_t) * VN * KG);
  for (int64_t r = 0; r < nb; ++r) {
    for (int64_t g = 0; g < KG; ++g) {
      float mx = 0.0f;
      for (int64_t k = g * I4_GROUP; k < (g + 1) * I4_GROUP; ++k) mx = std::max(mx, std::fabs(load1(w + r * K + k)));
      const uint16_t sb = f32_to_bf16(mx / 7.0f);
      const float sc = bf16_to_f32(sb);
      scales[g * VN + r] = sb;
      for (int64_t k = g * I4_GROUP; k < (g + 1) * I4_GROUP; ++k) {
        const float q = sc > 0.0f ? std::max(-7.0f, std::min(7.0f, std::nearbyint(load1(w + r * K + k) / sc))) : 0.0f;
        const uint8_t u = static_cast<uint8_t>(static_cast<int>(q) + 8);
        // row r's pair lane within its register of 16 rows: byte (r % 16) * 2 + k % 2 of the
        // 32-byte half (r / 32), low nibble for r % 32 < 16, high nibble otherwise
        uint8_t& byte = dst[(k / 2) * 64 + (r / 32) * 32 + (r % 16) * 2 + k % 2];
        byte = (r % 32) < 16 ? static_cast<uint8_t>((byte & 0xF0) | u) : static_cast<uint8_t>((byte & 0x0F) | (u << 4));
      }
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// MB rows of int16 x [K] against one int4 block: out[m][n] = sum over groups g (in order) of
// float(sum_k x[m][k] * q[n][k] over g) * s[n][g]. xsum[m][g]: the sum of x[m] over group g.
template <int MB>
__attribute__((noinline)) void dots_i4(const int16_t* const* x, const int32_t* const* xsum, const uint8_t* p,
                                       int64_t KG, float (*out)[VN]) {
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(p + 64 * (KG * I4_GROUP / 2));
  const __m512i low = _mm512_set1_epi16(0x0F);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) _mm512_storeu_ps(out[m] + 16 * j, _mm512_setzero_ps());
  for (int64_t g = 0; g < KG; ++g) {
    __m512i a[MB][VZ];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < VZ; ++j) a[m][j] = _mm512_setzero_si512();
    for (int64_t s = g * (I4_GROUP / 2); s < (g + 1) * (I4_GROUP / 2); ++s, p += 64) {
      const __m512i u0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512i u1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      const __m512i w[VZ] = {_mm512_and_si512(u0, low), _mm512_srli_epi16(u0, 4), _mm512_and_si512(u1, low),
                             _mm512_srli_epi16(u1, 4)};
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x[m] + 2 * s, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < VZ; ++j) a[m][j] = _mm512_dpwssd_epi32(a[m][j], xv, w[j]);
      }
    }
    __m512 sv[VZ];
    for (int j = 0; j < VZ; ++j)
      sv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * VN + 16 * j))), 16));
    for (int m = 0; m < MB; ++m) {
      const __m512i off = _mm512_set1_epi32(8 * xsum[m][g]);
      for (int j = 0; j < VZ; ++j) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][j], off));
        _mm512_storeu_ps(out[m] + 16 * j, _mm512_fmadd_ps(v, sv[j], _mm512_loadu_ps(out[m] + 16 * j)));
      }
    }
  }
}

#pragma GCC pop_options

void dots_i4_rows(int rows, const int16_t* const* x, const int32_t* const* xsum, const uint8_t* p, int64_t KG,
                  float (*out)[VN]) {
  switch (rows) {
    case 6: dots_i4<6>(x, xsum, p, KG, out); break;
    case 5: dots_i4<5>(x, xsum, p, KG, out); break;
    case 4: dots_i4<4>(x, xsum, p, KG, out); break;
    case 3: dots_i4<3>(x, xsum, p, KG, out); break;
    case 2: dots_i4<2>(x, xsum, p, KG, out); break;
    default: dots_i4<1>(x, xsum, p, KG, out); break;
  }
}

// y[m, :N] = x[m] @ w.T (+ b), w int4-packed (K a multiple of 32), for M rows of x.
void linear_i4(const float* x, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* bias, float* y,
               int threads) {
  const int64_t KG = K / I4_GROUP, row_bytes = i4_row_bytes(K);
  std::vector<int16_t> xq(M * K, 0);
  std::vector<int32_t> xg(M * KG, 0);
  std::vector<float> xs(M);
  for (int64_t m = 0; m < M; ++m) {
    float mx = 0.0f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(x[m * K + k]));
    xs[m] = mx > 0.0f ? mx / 32767.0f : 0.0f;
    if (mx > 0.0f)
      for (int64_t k = 0; k < K; ++k) {
        xq[m * K + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] / xs[m]));
        xg[m * KG + k / I4_GROUP] += xq[m * K + k];
      }
  }
  over_tiles_and_blocks<VN>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
    const uint8_t* p = wp + blk * row_bytes;
    alignas(64) float acc[DP_ROWS][VN];
    for (int64_t r0 = m0; r0 < m1; r0 += DP_ROWS) {
      const int64_t n = std::min<int64_t>(DP_ROWS, m1 - r0);
      const int16_t* rows[DP_ROWS];
      const int32_t* sums[DP_ROWS];
      for (int64_t i = 0; i < n; ++i) rows[i] = xq.data() + (r0 + i) * K, sums[i] = xg.data() + (r0 + i) * KG;
      dots_i4_rows(static_cast<int>(n), rows, sums, p, KG, acc);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < nb; ++j)
          y[(r0 + i) * N + n0 + j] = acc[i][j] * xs[r0 + i] + (bias ? bias[n0 + j] : 0.0f);
    }
  });
}

}  // namespace

// w [N, K] float32 or bfloat16 -> the packed layout (see pack_block) as [ceil(N / 4) * 4, K];
// dot_bf16 (bfloat16 w, a CPU with AVX512-BF16): the layout of linear_dp (pack_block_dp) as
// [ceil(N / 64), 64 * K2].
torch::Tensor pack_rows(torch::Tensor w, bool dot_bf16) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "pack_rows: w must be float32 or bfloat16 [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + PACK - 1) / PACK;
  if (dot_bf16) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "pack_rows: dot_bf16 needs bfloat16 weights");
    TORCH_CHECK(cpu_has_dot_bf16(), "pack_rows: dot_bf16 needs a CPU with AVX512-BF16");
    const int64_t vblocks = (N + VN - 1) / VN;
    auto out = torch::empty({vblocks, VN * k2(K)}, w.options());
    const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t blk = 0; blk < vblocks; ++blk) {
      const int64_t n0 = blk * VN;
      pack_block_dp(src + n0 * K, std::min<int64_t>(VN, N - n0), K, dst + blk * VN * k2(K));
    }
    return out;
  }
  auto out = torch::empty({blocks * PACK, K}, w.options());
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * PACK, nb = std::min<int64_t>(PACK, N - n0);
    if (w.scalar_type() == torch::kBFloat16) {
      const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      pack_block(src + n0 * K, nb, K, dst + n0 * K);
    } else {
      pack_block(w.data_ptr<float>() + n0 * K, nb, K, out.data_ptr<float>() + n0 * K);
    }
  }
  return out;
}

// w [N, K] float32 or bfloat16 -> blocks of VN rows of row_bytes (type T) each, packed by
// pack(src rows (float32 or bfloat16), rows in the block, K, dst): the quantized layouts' packing.
template <typename T, typename F>
torch::Tensor pack_quantized(torch::Tensor w, int64_t row_bytes, torch::ScalarType dtype, F&& pack) {
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + VN - 1) / VN;
  auto out = torch::empty({blocks, row_bytes}, torch::TensorOptions().dtype(dtype));
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * VN, nb = std::min<int64_t>(VN, N - n0);
    T* dst = out.data_ptr<T>() + blk * row_bytes;
    if (w.scalar_type() == torch::kBFloat16) {
      pack(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + n0 * K, nb, K, dst);
    } else {
      pack(w.data_ptr<float>() + n0 * K, nb, K, dst);
    }
  }
  return out;
}

// w [N, K] float32 or bfloat16 -> int8 with a scale per row (linear_i8's layout), [ceil(N / 64),
// 64 * K2 + 256] int8: a drafter's weights at half the bytes of bfloat16.
torch::Tensor pack_rows_int8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "pack_rows_int8: w must be float32 or bfloat16 [N, K]");
  TORCH_CHECK(cpu_has_vnni(), "pack_rows_int8: int8 products need a CPU with AVX512-VNNI");
  return pack_quantized<int8_t>(w, i8_row_bytes(w.size(1)), torch::kInt8,
                                [](const auto* src, int64_t nb, int64_t K, int8_t* dst) { pack_block_i8(src, nb, K, dst); });
}

// w [N, K] float32 or bfloat16 (K a multiple of 32) -> int4 with a bfloat16 scale per row and
// group of 32 k (linear_i4's layout), [ceil(N / 64), 36 * K] uint8: a quarter of bfloat16's bytes
// and an eighth more than a half of int8's.
torch::Tensor pack_rows_int4(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "pack_rows_int4: w must be float32 or bfloat16 [N, K]");
  TORCH_CHECK(w.size(1) % I4_GROUP == 0, "pack_rows_int4: K must be a multiple of ", I4_GROUP, ", got ", w.size(1));
  TORCH_CHECK(cpu_has_vnni(), "pack_rows_int4: int4 products need a CPU with AVX512-VNNI");
  return pack_quantized<uint8_t>(w, i4_row_bytes(w.size(1)), torch::kUInt8,
                                 [](const auto* src, int64_t nb, int64_t K, uint8_t* dst) { pack_block_i4(src, nb, K, dst); });
}

// Which packed layout wp is in (pack_rows, pack_rows_int8, pack_rows_int4), checked against the
// product's N x K.
Packed check_packed(const torch::Tensor& wp, int64_t N, int64_t K, const char* what) {
  if (wp.scalar_type() == torch::kInt8 && wp.dim() == 3) {
    const Packed gguf = gguf_layout(wp, N, K);
    TORCH_CHECK(gguf == Packed::gguf_q4_a8 && wp.is_contiguous(), what, ": GGUF Q4 records for int8 activations ",
                "(gguf_int8_activations) of ", N, " x ", K, " expected, got ", wp.sizes());
    return gguf;
  }
  if (wp.scalar_type() == torch::kInt8) {
    TORCH_CHECK(wp.dim() == 2 && wp.is_contiguous() && wp.size(0) == (N + VN - 1) / VN && wp.size(1) == i8_row_bytes(K),
                what, ": int8-packed weights of ", N, " x ", K, " expected (pack_rows_int8)");
    TORCH_CHECK(cpu_has_vnni(), what, ": int8-packed weights need a CPU with AVX512-VNNI");
    return Packed::int8;
  }
  if (wp.scalar_type() == torch::kUInt8) {
    if (wp.dim() == 3) {
      const Packed gguf = gguf_layout(wp, N, K);
      TORCH_CHECK(gguf != Packed::plain && wp.is_contiguous(), what, ": GGUF-packed weights (pack_rows_gguf) of ", N,
                  " x ", K, " expected, got ", wp.sizes());
      return gguf;
    }
    TORCH_CHECK(K % I4_GROUP == 0 && wp.dim() == 2 && wp.is_contiguous() && wp.size(0) == (N + VN - 1) / VN &&
                    wp.size(1) == i4_row_bytes(K),
                what, ": int4-packed weights of ", N, " x ", K, " expected (pack_rows_int4)");
    TORCH_CHECK(cpu_has_vnni(), what, ": int4-packed weights need a CPU with AVX512-VNNI");
    return Packed::int4;
  }
  TORCH_CHECK(wp.dim() == 2 && wp.is_contiguous() &&
                  (wp.scalar_type() == torch::kFloat32 || wp.scalar_type() == torch::kBFloat16),
              what, ": packed weights must be contiguous float32 or bfloat16 (pack_rows), int8 (pack_rows_int8) or uint8 (pack_rows_int4)");
  const int64_t blocks = (N + PACK - 1) / PACK;
  if (wp.scalar_type() == torch::kBFloat16 && wp.size(0) == (N + VN - 1) / VN && wp.size(1) == VN * k2(K)) {
    TORCH_CHECK(cpu_has_dot_bf16(), what, ": dot_bf16-packed weights need a CPU with AVX512-BF16");
    return Packed::dot_bf16;
  }
  TORCH_CHECK(wp.size(1) == K && wp.size(0) == blocks * PACK, what, ": packed weights of ", N, " x ",
              K, " expected, got ", wp.size(0), " x ", wp.size(1));
  return Packed::plain;
}

// y = x @ w.T (+ b) over M rows with packed weights of any layout.
void packed_product(const float* x, int64_t M, int64_t K, const torch::Tensor& wp, Packed layout, int64_t N,
                    const float* bias, float* y, int threads) {
  if (layout == Packed::dot_bf16) {
    linear_dp(x, M, K, reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), N, bias, y, threads);
  } else if (layout == Packed::int8) {
    linear_i8(x, M, K, wp.data_ptr<int8_t>(), N, bias, y, threads);
  } else if (layout == Packed::int4) {
    linear_i4(x, M, K, wp.data_ptr<uint8_t>(), N, bias, y, threads);
  } else if (layout == Packed::gguf_q4 || layout == Packed::gguf_q8 || layout == Packed::gguf_q4_a8) {
    linear_gguf(x, M, K, static_cast<const uint8_t*>(wp.data_ptr()), layout, N, bias, y, threads);
  } else if (wp.scalar_type() == torch::kBFloat16) {
    linear_packed(x, M, K, reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), N, bias, y, threads);
  } else {
    linear_packed(x, M, K, wp.data_ptr<float>(), N, bias, y, threads);
  }
}

// rows_linear with weights from pack_rows: x [M, K] float32, wp packed [ceil(N/4)*4, K], n = N.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, int64_t n, torch::Tensor b) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "packed_linear: x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Packed layout = check_packed(wp, n, K, "packed_linear");
  TORCH_CHECK(!b.defined() || b.numel() == 0 || (b.numel() == n && b.scalar_type() == torch::kFloat32 && b.is_contiguous()),
              "packed_linear: b must be contiguous float32 [N] or empty");
  const float* bp = b.defined() && b.numel() > 0 ? b.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, n}, x.options());
  packed_product(x.data_ptr<float>(), M, K, wp, layout, n, bp, y.data_ptr<float>(), at::get_num_threads());
  return y;
}

// packed_linear over the given rows of x [T, K] (float32 or bfloat16, widened exactly), without
// bias: y [len(rows), n] float32 (an LM head over the rows that sample: one call instead of an
// index, a widening and the product).
torch::Tensor packed_linear_rows(torch::Tensor x, std::vector<int64_t> rows, torch::Tensor wp, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "packed_linear_rows: x must be contiguous float32 or bfloat16 [T, K]");
  const int64_t T = x.size(0), K = x.size(1), M = static_cast<int64_t>(rows.size());
  const Packed layout = check_packed(wp, n, K, "packed_linear_rows");
  auto xs = torch::empty({M, K}, torch::TensorOptions().dtype(torch::kFloat32));
  float* xp = xs.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < T, "packed_linear_rows: row ", rows[i], " out of range");
    if (x.scalar_type() == torch::kFloat32) {
      std::memcpy(xp + i * K, x.data_ptr<float>() + rows[i] * K, sizeof(float) * K);
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + rows[i] * K;
      for (int64_t k = 0; k < K; ++k) xp[i * K + k] = bf16_to_f32(src[k]);
    }
  }
  auto y = torch::empty({M, n}, xs.options());
  packed_product(xp, M, K, wp, layout, n, nullptr, y.data_ptr<float>(), at::get_num_threads());
  return y;
}

// rows_linear: packed_linear on weights in their plain [N, K] layout (packed for the call: a copy
// of the weights per call; the engine packs once at load).
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rows_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "rows_linear: x and w disagree on K");
  if (b.defined() && b.numel() > 0) b = b.contiguous();
  return packed_linear(x, pack_rows(w, false), w.size(0), b);
}

}  // namespace cpu_kernels
