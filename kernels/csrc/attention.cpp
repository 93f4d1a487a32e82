// Row-invariant CPU kernels for decode and verification steps (AVX2 + FMA): a small-batch
// matmul, paged attention, and a whole pre-norm decoder layer built from them.
//
// rows_linear: y = x @ w.T (+ b); x [M, K] float32 (a few rows), w [N, K] float32 or bfloat16,
// b [N] float32 or empty; y [M, N] float32.
//
// Each output y[m, n] is one dot product computed by one thread in one fixed order (`dots`:
// two 8-lane accumulators over k in steps of 16, a fixed horizontal sum, then the scalar tail).
// That order depends on K only, never on M, on the row's place in x, on the weight rows it is
// blocked with, or on which thread runs it: a row gives bit-identical results whether it is
// computed alone (a one-token decode step) or with others (a verification of k drafts, other
// requests). Weight rows are taken 4 at a time, each load of x serving all 4, and a block's
// weights are read from memory once per call and reused from cache for every row of x, so a
// call on a few rows costs little more than one row while the product is memory-bound. bfloat16
// weights are widened to float32 in registers (a 16-bit shift): half the bytes, same arithmetic.
//
// On CPUs with AVX512-BF16, bfloat16 weights can be packed for dot-product instructions instead
// (linear_dp, below: activations rounded to bfloat16, `vdpbf16ps`), with the same row invariance.
//
// rows_attention: each query token over exactly its own paged context, each (token, head) in one
// thread's work item (a token and a range of kv heads). rows_layer: one decoder layer (norms, q/k/v, rope, KV write, attention, o, SwiGLU MLP)
// in one call, every row in float32 through the same per-row orders: the decode step's Python
// and small-op overhead (~20 torch ops per layer) becomes one call per layer.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);               // lanes (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));      // (0+4+2+6, 1+5+3+7, ...)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));  // + second
  return _mm_cvtss_f32(s);
}

inline __m256 load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 8 weights as float32: float32 as they are, bfloat16 widened in registers (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16(p); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }

// The fixed order of the short dot products (attention scores over head_dim, RMSNorm's sum of
// squares; the matmul has its own, below): two 8-lane accumulators, a over k % 16 in [0, 8) and
// b over [8, 16), in steps of 16; a remaining 8-wide step into a; then a + b, a fixed horizontal
// sum, then the scalar tail in k order. `NB` rows of w (float32, or bfloat16 widened in registers)
// share each load of x; each (x, w row) pair keeps exactly this order.
template <int NB, typename W>
inline void dots(const float* x, const W* const* w, int64_t K, float* out) {
  __m256 a[NB], b[NB];
  for (int j = 0; j < NB; ++j) a[j] = b[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int j = 0; j < NB; ++j) {
      a[j] = _mm256_fmadd_ps(x0, load8(w[j] + k), a[j]);
      b[j] = _mm256_fmadd_ps(x1, load8(w[j] + k + 8), b[j]);
    }
  }
  if (k + 8 <= K) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int j = 0; j < NB; ++j) a[j] = _mm256_fmadd_ps(x0, load8(w[j] + k), a[j]);
    k += 8;
  }
  for (int j = 0; j < NB; ++j) {
    float s = hsum(_mm256_add_ps(a[j], b[j]));
    for (int64_t t = k; t < K; ++t) s += x[t] * load1(w[j] + t);
    out[j] = s;
  }
}

// exp of 8 floats (AVX2; Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial
// for e^r, then 2^n through the exponent bits), within 2 ulp of e^x; x < -87.34 gives 0 (no
// denormals), x > 88.376 is taken as 88.376 (2.4e38: the softmax and SiLU never need more).
// Element-wise and branch-free: a value's exp does not depend on its neighbours, so the
// kernels' row invariance holds; ~10x faster than a scalar std::exp per element.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// f(x8) over n floats in place, 8 at a time; the tail through a zero-padded register, so every
// element takes the same instructions wherever it sits.
template <typename F>
inline void map8(float* x, int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, f(_mm256_loadu_ps(x + i), i));
  if (i < n) {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, x + i, sizeof(float) * (n - i));
    _mm256_store_ps(tmp, f(_mm256_load_ps(tmp), i));
    std::memcpy(x + i, tmp, sizeof(float) * (n - i));
  }
}

// The first min(n, 8) floats of p, zeros after (map8's tail).
inline __m256 load_tail(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, sizeof(float) * n);
  return _mm256_load_ps(tmp);
}

inline float dot_f32(const float* x, const float* w, int64_t K) {
  float s;
  dots<1>(x, &w, K, &s);
  return s;
}

// ---- the matmul: packed weights, a fixed order per output ------------------------------------
// Weights are packed (pack_rows) in blocks of 4 rows stored in the order the kernel reads them:
// for each 8-wide step of K, the 8 weights of row 0, then of rows 1, 2, 3 (32 values; bfloat16:
// rows 0 and 1 interleaved, then rows 2 and 3, see pack_block); then the scalar tail K % 8 as
// 4 x (K % 8) (rows past N are zeros). A product is then one sequential
// stream, which the hardware prefetcher follows far better than four rows K apart (measured
// 15-17 GB/s instead of 9-10 on bfloat16 here).
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
  // (`python -m bench.bench_kernels --step --layouts widen`: bfloat16 5-23% faster from 3 rows,
  // the same at 1; float32 12-27% from 5 rows, but 1 row 27% slower: see linear_packed)
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
// Rows of x per tile: the weights stream once per tile while the tile's rows stay in L2 (for
// K = 1408, 48 float32 rows are 270 KB); without tiles a long prefill re-read all of x from
// L3 for every block of 4 weight rows. Decode and verification steps (<= 16 rows) are one tile.
constexpr int64_t M_TILE = 48;

// The tiles of M_TILE rows of x, and in each the blocks of 4 weight rows split among threads:
// f(m0, m1, blk, n0, nb) per block (rows n0 .. n0 + nb of y).
template <int64_t BW = PACK, typename F>
void over_tiles_and_blocks(int64_t M, int64_t N, int threads, F&& f) {
  const int64_t blocks = (N + BW - 1) / BW;
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int64_t m1 = std::min(M, m0 + M_TILE);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t blk = 0; blk < blocks; ++blk) f(m0, m1, blk, blk * BW, std::min<int64_t>(BW, N - blk * BW));
  }
}

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
  over_tiles_and_blocks(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
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
// reduction (the layout before, 4 outputs of 16 lanes each, spent ~20% of a verification's
// instructions on them; `python -m bench.bench_kernels --step`: 6 rows 1.1x faster, 16 rows 1.2x).
//
// The order of every output y[m, n] = bf16(x[m]) . w[n]: one float32 lane accumulating the pairs
// (2s, 2s + 1) in k order, one `vdpbf16ps` per pair (K zero-padded to K2, even: a padded pair adds
// exact zeros). It depends on K only: the same bits alone or next to other rows, as for the path
// above (not the same bits as that path: the activations are rounded, and the sums run in
// another order).
constexpr int64_t KB = 32;  // bfloat16 values per 512-bit register
inline int64_t k32(int64_t K) { return (K + KB - 1) / KB * KB; }
inline int64_t k2(int64_t K) { return (K + 1) / 2 * 2; }
constexpr int64_t VN = 64, VZ = VN / 16;  // outputs per block, registers of 16 outputs per block

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

// out[j] = _mm512_reduce_add_ps(v[j]) for 4 vectors at once, by the very additions of GCC's
// reduce (16 -> 8 lanes: hi + lo; 8 -> 4: hi + lo; then (0 + 2) + (1 + 3)), each vector's in a
// quarter of the registers: the same bits, ~14 instructions instead of ~40.
inline void reduce4(const __m512* v, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)));
  // [a, b, c, d] 8-lane sums -> each one's upper 4 lanes + its lower 4, one vector per quarter
  const __m512 t6 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)),
                                  _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)));
  const __m512 t8 = _mm512_add_ps(t6, _mm512_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 t10 = _mm512_add_ps(t8, _mm512_permute_ps(t8, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 packed = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t10);
  _mm_storeu_ps(out, _mm512_castps512_ps128(packed));
}

// reduce4's tree for up to 16 vectors at once (n <= 16; v[n..] are not read): out[r] = the sum of
// v[r]'s lanes, each one's adds in reduce4's order (lane l + lane l + 8, then + 4, + 2, + 1), so the
// same bits; the vectors stay in registers and the sums come out together (one contiguous store,
// no spill and scatter per 4).
__attribute__((always_inline)) inline void reduce16(const __m512* v, int n, float* out) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 w[8], x[4], z[2];
  const int nw = (n + 1) / 2, nx = (n + 3) / 4;
  for (int k = 0; k < nw; ++k) {  // rows 2k (lanes 0-7), 2k + 1 (8-15): l + (l + 8)
    const __m512 a = v[2 * k], b = 2 * k + 1 < n ? v[2 * k + 1] : zero;
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (int k = nw; k < 2 * nx; ++k) w[k] = zero;
  for (int k = 0; k < nx; ++k)  // rows 4k .. 4k + 3, one per quarter: l + (l + 4)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int k = nx; k < 4; ++k) x[k] = zero;
  for (int m = 0; m < 2; ++m)  // quarter q: rows 8m + q (lanes 0, 1), 8m + 4 + q (2, 3): l + (l + 2)
    z[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter q: rows q, 4 + q, 8 + q, 12 + q: l + (l + 1)
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 sums = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), sums);
}

#pragma GCC pop_options

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
// The weights a block's first group of rows reads DP_PREFETCH bytes ahead of it are prefetched
// into L2. Without it the hardware prefetcher, which runs a short way ahead of the demand stream,
// left the memory idle while a step of several rows computed (cold from DRAM: every step, a
// step's weights are 80 MB); steps of 1-5 rows stream as fast without it or faster (stop 35, the
// vertical layout, in-process toggle, 201 interleaved reps of a step's products, two runs: 4 rows
// 4.30 -> 3.73 and 4.37 -> 4.18 ms without it, 5 rows 4.12 -> 3.89 and 4.07 -> 3.82; 6 rows
// 3.87 vs 4.14 and 4.00 vs 3.95, kept; 2 rows 3.63 vs 5.05 with it).
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
// then costs about what one row does, the weight stream (a 16-row step's products were 3.6x a
// one-row step's with `vdpbf16ps` on this Sapphire Rapids host, compute-bound at ~54 GMAC/s).
// The order of every output: one float32 accumulator tile over k in chunks of 16 pairs (32 k),
// each chunk's 32 products added by the tile op in the hardware's own order. A row's outputs
// depend on its own x row and the weights only: the same bits alone, with 16 rows or with padding
// rows (tested), but not `vdpbf16ps`'s bits (another order of additions). A product takes this
// path where amx_products() is on and its pairs are a multiple of 16 (K % 32 == 0 after the
// pairing: every product of the shipped models), whatever its number of rows, so a one-token step
// and a verification still agree bit for bit; other K keep the `vdpbf16ps` path, also for every M.
static bool cpu_has_amx_bf16() {
  static const bool yes = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) return false;
    // Linux hands the 8 KB tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return yes;
}

// Whether dp-packed products run on AMX where the CPU has it (default on; SPECDECODE_CPU_AMX=0
// turns it off at load, tests to compare). Switching it changes the products' bits: the engine
// never switches while it runs.
static bool g_amx = true;

static bool amx_products() { return g_amx && cpu_has_amx_bf16(); }

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

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
// of the next chunk's lines. Before, groups of 6 ran over the whole block in turn and only the
// first prefetched: the memory idled while the others re-read the block from L2 (7 rows: a
// one-row pass after the 6-row one, ~1.2x a 6-row step; `python -m bench.bench_kernels --step
// --reps 201`, two runs: 7 rows 1.01-1.02x faster, 8 rows 1.05-1.10x, 10 rows 1.03-1.07x, 12
// rows 1.00-1.04x). Larger tiles (prefill, batches) keep that order: their groups are bound by
// the multiply-adds, and chunking cost them ~5%.
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
// (s rounded to bfloat16 first, so q uses the scale the kernel reads); per-row int4 scales cost
// the shipped head 10% of its accepted length, groups of 32 none (bench/eval in the model card).
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

inline uint16_t f32_to_bf16(float f);  // (below: round to nearest even)

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

// Paged attention of T query tokens [T, H, D], each over exactly its own context (see
// rows_attention). The G = H / Hkv query heads of one kv head are computed together, each key
// and value row read (and widened) once for all G; every (token, head) keeps its own fixed
// order: scores over D (`dots`), max, exponentials and their sum in position order, the output
// accumulated in position order, then divided by the sum.
template <typename C>
void attention_rows(const float* q, int64_t T, int64_t H, int64_t D, const C* kc, const C* vc, int64_t bs,
                    int64_t Hkv, const int64_t* tables, int64_t max_blocks, const int64_t* lens, float scale,
                    float* out, int threads, const int64_t* tree = nullptr) {
  // tree (rows_attention's: token t's tree root position and mask bits, or none): a token of a
  // tree skips the nodes it does not see, a score of -inf and no value (an exact zero in its
  // sums: the same bits as attention over a slot table of only the positions it sees)
  const int64_t G = H / Hkv, row_stride = Hkv * D;
  // Work items: (token, a range of kv heads). A position's row holds every kv head's key (value)
  // side by side, and a block's rows are contiguous, so an item over all kv heads reads its
  // context as one sequential stream, which the hardware prefetcher follows (one kv head per item
  // read 128 of every 512 bytes, a stride it did not: ~2x slower on a cold cache). Heads are
  // split only to give every thread work: S ranges per token, the fewest that make T * S items a
  // multiple of the threads (or S = Hkv).
  int64_t S = 1;
  while (S < Hkv && threads > 1 && ((T * S) % threads != 0 || T * S < threads)) ++S;
  const int64_t items = T * S;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    std::vector<float> scores, acc, mx, sum;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t t = it / S, s = it % S, L = lens[t];
      const int64_t k0 = s * Hkv / S, k1 = (s + 1) * Hkv / S, M = (k1 - k0) * G;  // query heads k0*G .. k1*G
      const int64_t root = tree != nullptr ? tree[2 * t] : -1;
      const uint64_t seen = tree != nullptr ? static_cast<uint64_t>(tree[2 * t + 1]) : 0;
      auto unseen = [&](int64_t p) { return root >= 0 && p >= root && !((seen >> (p - root)) & 1u); };
      const float* qv = q + (t * H + k0 * G) * D;  // their queries, consecutive
      scores.resize(M * L);
      acc.assign(M * D, 0.0f);
      mx.assign(M, -INFINITY);
      sum.resize(M);
      // position p's key/value row: block tables[t, p / bs], row p % bs (walked block by block)
      const int64_t* table = tables + t * max_blocks;
      // While a block's rows are used, the next block's same rows (this item's kv heads) are
      // prefetched: a request's blocks lie anywhere in the cache, and the hardware prefetcher
      // starts each block's stream anew (measured: cold-cache attention over scattered blocks
      // -20%, 16 concurrent requests +5% end to end; no prefetch instruction changes a result).
      const int64_t span = (k1 - k0) * D * static_cast<int64_t>(sizeof(C));
      auto prefetch = [&](const C* row) {
        const char* b = reinterpret_cast<const char*>(row + k0 * D);
        for (int64_t o = 0; o < span; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
      };
      auto for_each_row = [&](const C* cache, auto&& f) {
        for (int64_t p0 = 0; p0 < L; p0 += bs) {
          const C* base = cache + table[p0 / bs] * bs * row_stride;
          const int64_t n = std::min(bs, L - p0), n_next = std::min(bs, L - p0 - bs);
          const C* next = n_next > 0 ? cache + table[p0 / bs + 1] * bs * row_stride : nullptr;
          for (int64_t i = 0; i < n; ++i) {
            if (i < n_next) prefetch(next + i * row_stride);
            f(p0 + i, base + i * row_stride);
          }
        }
      };
      for_each_row(kc, [&](int64_t p, const C* row) {
        if (unseen(p)) {
          for (int64_t j = 0; j < M; ++j) scores[j * L + p] = -INFINITY;
          return;
        }
        for (int64_t j = 0; j < M; ++j) {
          const C* kr = row + (k0 + j / G) * D;
          float sc;
          dots<1>(qv + j * D, &kr, D, &sc);
          sc *= scale;
          scores[j * L + p] = sc;
          mx[j] = sc > mx[j] ? sc : mx[j];
        }
      });
      for (int64_t j = 0; j < M; ++j) {
        float total = 0.0f;
        float* sc = scores.data() + j * L;
        const __m256 m = _mm256_set1_ps(mx[j]);
        map8(sc, L, [&](__m256 v, int64_t) { return exp8(_mm256_sub_ps(v, m)); });
        for (int64_t p = 0; p < L; ++p) total += sc[p];
        sum[j] = total;
      }
      for_each_row(vc, [&](int64_t p, const C* row) {
        if (unseen(p)) return;
        for (int64_t kvh = k0; kvh < k1; ++kvh) {
          const C* vv = row + kvh * D;
          const int64_t j0 = (kvh - k0) * G;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) {
            const __m256 v = load8(vv + d);
            for (int64_t g = 0; g < G; ++g) {
              float* a = acc.data() + (j0 + g) * D + d;
              _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[(j0 + g) * L + p]), v, _mm256_loadu_ps(a)));
            }
          }
          for (; d < D; ++d) {
            const float v = load1(vv + d);
            for (int64_t g = 0; g < G; ++g) acc[(j0 + g) * D + d] += scores[(j0 + g) * L + p] * v;
          }
        }
      });
      for (int64_t j = 0; j < M; ++j) {
        const float inv = 1.0f / sum[j];
        float* o = out + (t * H + k0 * G + j) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[j * D + d] * inv;
      }
    }
  }
}

// The same attention with 512-bit registers, for CPUs with AVX-512 (F, BW, VL) and head_dim a
// multiple of 16 up to 256: the same bits as attention_rows, ~2x faster over a step's cold KV.
//  - A score is `dots`' order in one register: lanes 0-7 accumulate what `dots`' a does and
//    lanes 8-15 what its b does (the same fused multiply-adds, in the same order), and
//    _mm512_reduce_add_ps's tree (halves, then quarters, then pairs: reduce4, 4 at a time) is
//    hsum(a + b)'s. Each key row is widened once for the G query heads that read it.
//  - Scores are kept position-major, so a head's max, exponentials and position-ordered sum run
//    8 heads per instruction, each lane in attention_rows' order.
//  - The output accumulates in registers, HB heads x D / 16 registers per pass over the values,
//    each element in position order.
//  - Memory: the key pass prefetches each value row into L2 (the value pass then runs from
//    cache) and the next block's key rows into L1; the value pass prefetches the next item's
//    key rows into L2, so the memory works while the values are summed (a step's caches are
//    cold: the weights streamed through the caches since this layer ran last).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Every cache line of [p, p + span) into L1 (hint 0) or L2.
inline void prefetch_span(const void* p, int64_t span, int hint) {
  const char* b = static_cast<const char*>(p);
  if (hint == 0) for (int64_t o = 0; o < span; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
  else for (int64_t o = 0; o < span; o += 64) _mm_prefetch(b + o, _MM_HINT_T1);
}

// A group's scores at position p (token i sees [0, L0 + i), MT rows per token): the rows of the
// tokens that do not see p set to -inf; returns the first token that does.
inline int64_t unseen_rows(float* sc, int64_t p, int64_t L0, int64_t MT) {
  const int64_t i0 = std::max<int64_t>(0, p - L0 + 1);
  for (int64_t j = 0; j < i0 * MT; ++j) sc[j] = -INFINITY;
  return i0;
}

// Scores j of one position, reduced 4 at a time (reduce4: each its own tree) into sc[j].
struct ScoreBatch {
  float* sc;
  alignas(64) __m512 a[4];
  int64_t dst[4];
  int n = 0;
  void add(__m512 v, int64_t j) {
    a[n] = v;
    dst[n++] = j;
    if (n == 4) flush();
  }
  void flush() {
    if (!n) return;
    alignas(16) float r4[4];
    for (int i = n; i < 4; ++i) a[i] = _mm512_setzero_ps();
    reduce4(a, r4);
    for (int k = 0; k < n; ++k) sc[dst[k]] = r4[k];
    n = 0;
  }
};

// One position's M scores (Mp, padded to 8): sc = sc * scale, pad lanes -inf; mx = max(mx, sc).
inline void scale_and_max(float* sc, int64_t M, int64_t Mp, float scale, float* mx) {
  for (int64_t c = 0; c < Mp; c += 8) {
    const int64_t live_n = std::min<int64_t>(8, M - c);
    const __mmask8 live = live_n >= 8 ? __mmask8(0xFF) : __mmask8((1u << live_n) - 1u);
    __m256 v = _mm256_mul_ps(_mm256_maskz_loadu_ps(live, sc + c), _mm256_set1_ps(scale));
    v = _mm256_mask_blend_ps(live, _mm256_set1_ps(-INFINITY), v);
    _mm256_storeu_ps(sc + c, v);
    _mm256_storeu_ps(mx + c, _mm256_max_ps(v, _mm256_loadu_ps(mx + c)));  // v > mx ? v : mx
  }
}

// Each row's exponentials exp(s - max) over its positions, in place of the scores, and their
// float32 sums in position order (rows c.. of an 8-lane chunk run to the chunk's last row's
// positions: an earlier token's -inf scores there give exact zeros, added to a non-negative sum).
inline void softmax_exps(float* scores, int64_t M, int64_t Mp, float* mx, const int64_t* row_len, float* sum) {
  for (int64_t c = M; c < Mp; ++c) mx[c] = 0.0f;  // pad lanes: exp(-inf - 0) = 0
  for (int64_t c = 0; c < Mp; c += 8) {
    const __m256 m = _mm256_loadu_ps(mx + c);
    __m256 total = _mm256_setzero_ps();
    const int64_t pe = row_len[std::min(M, c + 8) - 1];
    for (int64_t p = 0; p < pe; ++p) {
      float* sc = scores + p * Mp + c;
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc), m));
      _mm256_storeu_ps(sc, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(sum + c, total);
  }
}

// Query tokens of one request are taken together (a group: consecutive tokens with the same block
// table, each one position after the last, up to GROUP_TOKENS): each key and value row is loaded
// and widened once for the group's G * tokens query rows instead of once per token, as a
// verification's k + 1 tokens are. A row of a token that does not see a position (a later token's
// key) gets -inf for its score there and skips it in the values, so each (token, head) keeps
// exactly its own operations: the same bits alone or grouped (the exponentials of the skipped
// scores are exact zeros added to a non-negative sum).
constexpr int64_t GROUP_TOKENS = 8;

// The groups of tokens [starts[i], starts[i + 1]) (see GROUP_TOKENS).
std::vector<int64_t> token_groups(int64_t T, const int64_t* tables, int64_t max_blocks, const int64_t* lens) {
  std::vector<int64_t> starts{0};
  for (int64_t t = 1; t < T; ++t) {
    const bool same = t - starts.back() < GROUP_TOKENS && lens[t] == lens[t - 1] + 1 &&
                      std::memcmp(tables + t * max_blocks, tables + (t - 1) * max_blocks, sizeof(int64_t) * max_blocks) == 0;
    if (!same) starts.push_back(t);
  }
  starts.push_back(T);
  return starts;
}

template <int NZ, typename C>
void attention_rows_512(const float* q, int64_t T, int64_t H, int64_t D, const C* kc, const C* vc, int64_t bs,
                        int64_t Hkv, const int64_t* tables, int64_t max_blocks, const int64_t* lens, float scale,
                        float* out, int threads) {
  constexpr int HB = NZ >= 16 ? 1 : 16 / NZ;  // heads per value pass: HB * NZ accumulators
  const int64_t G = H / Hkv, row_stride = Hkv * D;
  const std::vector<int64_t> group_start = token_groups(T, tables, max_blocks, lens);
  const int64_t NG = static_cast<int64_t>(group_start.size()) - 1;
  int64_t S = 1;  // as attention_rows, over groups
  while (S < Hkv && threads > 1 && ((NG * S) % threads != 0 || NG * S < threads)) ++S;
  const int64_t items = NG * S;
  const int nt = (threads > 1 && items > 1) ? threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = nt > 1 ? omp_get_thread_num() : 0;
    const int64_t chunk = (items + nt - 1) / nt, it0 = std::min(items, tid * chunk),
                  it1 = std::min(items, it0 + chunk);
    std::vector<float> scores, acc, mx, sum;
    std::vector<int64_t> row_len;
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t gi = it / S, s = it % S, t0 = group_start[gi], n = group_start[gi + 1] - t0;
      const int64_t k0 = s * Hkv / S, k1 = (s + 1) * Hkv / S, MT = (k1 - k0) * G, M = n * MT;
      const int64_t L0 = lens[t0], L = lens[t0 + n - 1];  // token i sees positions [0, L0 + i)
      const int64_t Mp = (M + 7) / 8 * 8;  // a position's scores, padded to whole 8-lane registers
      scores.resize(L * Mp);
      acc.resize(M * D);
      row_len.resize(M);
      for (int64_t j = 0; j < M; ++j) row_len[j] = L0 + j / MT;
      const int64_t* table = tables + t0 * max_blocks;
      const int64_t span = (k1 - k0) * D * static_cast<int64_t>(sizeof(C));
      auto row_of = [&](const C* cache, const int64_t* tab, int64_t p) {
        return cache + (tab[p / bs] * bs + p % bs) * row_stride + k0 * D;
      };
      auto prefetch = [&](const C* row, int hint) { prefetch_span(row, span, hint); };
      // q row j: token t0 + j / MT, head k0 * G + j % MT
      auto q_of = [&](int64_t j) { return q + ((t0 + j / MT) * H + k0 * G + j % MT) * D; };
      // scores, position-major: scores[p * Mp + j] = (q_j . k_p) * scale; unseen and pad lanes -inf
      mx.assign(Mp, -INFINITY);
      for (int64_t p = 0; p < L; ++p) {
        if (p + bs < L) prefetch(row_of(kc, table, p + bs), 0);
        prefetch(row_of(vc, table, p), 1);
        const C* row = row_of(kc, table, p);
        float* sc = scores.data() + p * Mp;
        const int64_t i0 = unseen_rows(sc, p, L0, MT);
        ScoreBatch batch{sc};
        for (int64_t h = 0; h < k1 - k0; ++h) {
          __m512 w[NZ];
          for (int z = 0; z < NZ; ++z) w[z] = load16(row + h * D + 16 * z);
          for (int64_t i = i0; i < n; ++i) {
            for (int64_t g = 0; g < G; ++g) {
              const int64_t j = i * MT + h * G + g;
              const float* qq = q_of(j);
              __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(qq), w[0], _mm512_setzero_ps());  // as dots: 0 + q k
              for (int z = 1; z < NZ; ++z) v = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * z), w[z], v);
              batch.add(v, j);
            }
          }
        }
        batch.flush();
        scale_and_max(sc, M, Mp, scale, mx.data());
      }
      sum.resize(Mp);
      softmax_exps(scores.data(), M, Mp, mx.data(), row_len.data(), sum.data());
      // values: rows [j0, j0 + HB) per pass, their accumulators in registers, each row over its
      // own positions only
      const bool next = it + 1 < it1;
      const int64_t gn = (it + 1) / S, tn = next ? group_start[gn] : 0;
      const int64_t Ln = next ? lens[group_start[gn + 1] - 1] : 0;
      for (int64_t j0 = 0; j0 < M; j0 += HB) {
        const int64_t hb = std::min<int64_t>(HB, M - j0);
        __m512 ac[HB][NZ];
        for (int h = 0; h < HB; ++h)
          for (int z = 0; z < NZ; ++z) ac[h][z] = _mm512_setzero_ps();
        const int64_t pe = row_len[j0 + hb - 1];
        for (int64_t p = 0; p < pe; ++p) {
          if (j0 == 0 && p < Ln) {
            const int64_t sn = (it + 1) % S, kn0 = sn * Hkv / S;
            const char* b = reinterpret_cast<const char*>(
                kc + (tables[tn * max_blocks + p / bs] * bs + p % bs) * row_stride + kn0 * D);
            const int64_t spn = ((sn + 1) * Hkv / S - kn0) * D * static_cast<int64_t>(sizeof(C));
            for (int64_t o = 0; o < spn; o += 64) _mm_prefetch(b + o, _MM_HINT_T1);
          }
          const C* row = row_of(vc, table, p);
          const float* sc = scores.data() + p * Mp + j0;
          __m512 w[NZ];
          int64_t prev = -1;
          for (int h = 0; h < HB; ++h) {
            if (h >= hb) break;
            if (p >= row_len[j0 + h]) continue;  // (an earlier token's row: a later token's position)
            const int64_t kvh = ((j0 + h) % MT) / G;
            if (kvh != prev) {
              for (int z = 0; z < NZ; ++z) w[z] = load16(row + kvh * D + 16 * z);
              prev = kvh;
            }
            const __m512 e = _mm512_set1_ps(sc[h]);
            for (int z = 0; z < NZ; ++z) ac[h][z] = _mm512_fmadd_ps(e, w[z], ac[h][z]);
          }
        }
        for (int h = 0; h < hb; ++h)
          for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc.data() + (j0 + h) * D + 16 * z, ac[h][z]);
      }
      for (int64_t j = 0; j < M; ++j) {
        const float inv = 1.0f / sum[j];
        float* o = out + ((t0 + j / MT) * H + k0 * G + j % MT) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[j * D + d] * inv;
      }
    }
  }
}

#pragma GCC pop_options

// attention_rows_512 where it runs (and `wide`), else attention_rows: the same bits either way.
template <typename C>
void attention_any(const float* q, int64_t T, int64_t H, int64_t D, const C* kc, const C* vc, int64_t bs, int64_t Hkv,
                   const int64_t* tables, int64_t max_blocks, const int64_t* lens, float scale, float* out,
                   int threads, bool wide) {
  if (wide && D % 16 == 0 && D <= 256) {
    switch (D / 16) {
      case 1: return attention_rows_512<1>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
      case 2: return attention_rows_512<2>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
      case 4: return attention_rows_512<4>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
      case 8: return attention_rows_512<8>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
      case 16: return attention_rows_512<16>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
      default: break;
    }
  }
  attention_rows(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads);
}

// float32 -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16)).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// out = x * rsqrt(mean(x^2) + eps) * w over one row of n (sum of squares in `dots` order).
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float ss = dot_f32(x, x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rotate-half rope of one head in place: x * cos + rotate_half(x) * sin.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

const float* opt_f32(const torch::Tensor& t, const char* what) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "rows_layer: ", what,
              " must be contiguous float32 (or empty)");
  return t.data_ptr<float>();
}

}  // namespace

static bool cpu_has_dot_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

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

static bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
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
enum class Packed { plain, dot_bf16, int8, int4 };

static Packed check_packed(const torch::Tensor& wp, int64_t N, int64_t K, const char* what) {
  if (wp.scalar_type() == torch::kInt8) {
    TORCH_CHECK(wp.dim() == 2 && wp.is_contiguous() && wp.size(0) == (N + VN - 1) / VN && wp.size(1) == i8_row_bytes(K),
                what, ": int8-packed weights of ", N, " x ", K, " expected (pack_rows_int8)");
    TORCH_CHECK(cpu_has_vnni(), what, ": int8-packed weights need a CPU with AVX512-VNNI");
    return Packed::int8;
  }
  if (wp.scalar_type() == torch::kUInt8) {
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
static void packed_product(const float* x, int64_t M, int64_t K, const torch::Tensor& wp, Packed layout, int64_t N,
                           const float* bias, float* y, int threads) {
  if (layout == Packed::dot_bf16) {
    linear_dp(x, M, K, reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), N, bias, y, threads);
  } else if (layout == Packed::int8) {
    linear_i8(x, M, K, wp.data_ptr<int8_t>(), N, bias, y, threads);
  } else if (layout == Packed::int4) {
    linear_i4(x, M, K, wp.data_ptr<uint8_t>(), N, bias, y, threads);
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

// ---- rows attention by dot-product instructions (AVX512-BF16, bfloat16 caches) --------------
// attention_rows_512's work items (a group of a request's consecutive tokens, a range of kv heads)
// with its products in bfloat16 as torch's bfloat16 attention takes them: each score from q
// rounded to bfloat16 and the cached key (`vdpbf16ps` over D, 16 lanes, then reduce4's tree),
// scaled, float32 softmax (exp8, max and sum in position order), and the output from the
// exponentials rounded to bfloat16 against the cached values, two positions per `vdpbf16ps` (the
// value rows of positions 2i and 2i + 1 interleaved once per kv head for all the rows that read
// them; the sum divides by the unrounded exponentials' sum). Twice the multiply-adds per
// instruction and no widening of the cache rows: ~2x faster than the float32 kernels. A row's
// operations depend on its own q, its position and the cache only (a position it does not see has
// an exact zero weight, and a pair past the group's last position a zero value row), so the
// same bits alone, grouped or next to other requests; not attention_rows' bits (rounded q and
// weights). Where it runs: bfloat16 caches, head_dim 32, 64, 128 or 256, a CPU with AVX512-BF16,
// and `set_dot_attention` on (cpu_kernels turns it off with SPECDECODE_CPU_BF16_DOT=0).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

template <int NQ>  // registers of 32 bfloat16 per head row: D = 32 * NQ
void attention_rows_dp(const float* q, int64_t T, int64_t H, int64_t D, const uint16_t* kc, const uint16_t* vc,
                       int64_t bs, int64_t Hkv, const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                       float scale, float* out, int threads) {
  constexpr int NV = 2 * NQ;                    // value registers of 16 float32 per row
  constexpr int RB = NV >= 24 ? 1 : 24 / NV;    // rows per value pass: RB * NV accumulators
  const int64_t G = H / Hkv, row_stride = Hkv * D;
  const std::vector<int64_t> group_start = token_groups(T, tables, max_blocks, lens);
  const int64_t NG = static_cast<int64_t>(group_start.size()) - 1;
  int64_t S = 1;
  while (S < Hkv && threads > 1 && ((NG * S) % threads != 0 || NG * S < threads)) ++S;
  const int64_t items = NG * S;
  const int nt = (threads > 1 && items > 1) ? threads : 1;
  // vpermt2w indices: pair register c of positions (a, b) holds (a[16c + i], b[16c + i]) in lane i
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<uint16_t>(i), lo_idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    hi_idx[2 * i] = static_cast<uint16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<uint16_t>(48 + i);
  }
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = nt > 1 ? omp_get_thread_num() : 0;
    const int64_t chunk = (items + nt - 1) / nt, it0 = std::min(items, tid * chunk),
                  it1 = std::min(items, it0 + chunk);
    std::vector<float> scores, mx, sum;
    std::vector<uint16_t> qb;
    std::vector<uint32_t> eb;
    std::vector<int64_t> row_len, kofs;
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t gi = it / S, s = it % S, t0 = group_start[gi], n = group_start[gi + 1] - t0;
      const int64_t k0 = s * Hkv / S, k1 = (s + 1) * Hkv / S, MT = (k1 - k0) * G, M = n * MT;
      const int64_t L0 = lens[t0], L = lens[t0 + n - 1];  // token i sees positions [0, L0 + i)
      const int64_t Mp = (M + 7) / 8 * 8;
      const int64_t* table = tables + t0 * max_blocks;
      scores.resize(L * Mp);
      eb.assign((L / 2 + 1) * Mp, 0);
      row_len.resize(M);
      qb.resize(M * D);
      kofs.resize(M);
      for (int64_t j = 0; j < M; ++j) {
        kofs[j] = (j % MT) / G * D;  // row j's kv head, within a cache row's heads k0 ..
        row_len[j] = L0 + j / MT;
        const float* qq = q + ((t0 + j / MT) * H + k0 * G + j % MT) * D;
        for (int64_t d = 0; d < D; ++d) qb[j * D + d] = f32_to_bf16(qq[d]);
      }
      auto row_of = [&](const uint16_t* cache, int64_t p) {
        return cache + (table[p / bs] * bs + p % bs) * row_stride + k0 * D;
      };
      const int64_t span = (k1 - k0) * D * 2;
      auto prefetch = [&](const uint16_t* row, int hint) { prefetch_span(row, span, hint); };
      // scores, position-major as attention_rows_512's
      mx.assign(Mp, -INFINITY);
      for (int64_t p = 0; p < L; ++p) {
        if (p + bs < L) prefetch(row_of(kc, p + bs), 0);
        prefetch(row_of(vc, p), 1);
        const uint16_t* row = row_of(kc, p);
        float* sc = scores.data() + p * Mp;
        const int64_t i0 = unseen_rows(sc, p, L0, MT);
        // the rows that see p, 16 at a time in row order (row j: token j / MT, head j % MT)
        auto dot = [&](int64_t j) {
          const uint16_t* kk = row + kofs[j];
          const uint16_t* qq = qb.data() + j * D;
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qq),
                                      (__m512bh)_mm512_loadu_si512(kk));
          for (int z = 1; z < NQ; ++z)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qq + 32 * z), (__m512bh)_mm512_loadu_si512(kk + 32 * z));
          return a;
        };
        int64_t j0 = i0 * MT;
        for (; j0 + 16 <= M; j0 += 16) {  // (a constant count: the 16 stay in registers)
          __m512 v[16];
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) v[r] = dot(j0 + r);
          reduce16(v, 16, sc + j0);
        }
        if (j0 + 8 <= M) {
          __m512 v[8];
#pragma GCC unroll 8
          for (int r = 0; r < 8; ++r) v[r] = dot(j0 + r);
          reduce16(v, 8, sc + j0);
          j0 += 8;
        }
        if (j0 < M) {
          __m512 v[8];
          const int nj = static_cast<int>(M - j0);
          for (int r = 0; r < nj; ++r) v[r] = dot(j0 + r);
          reduce16(v, nj, sc + j0);
        }
        scale_and_max(sc, M, Mp, scale, mx.data());
      }
      // exponentials: float32 sums in position order, the weights rounded to bfloat16 (eb)
      sum.resize(Mp);
      softmax_exps(scores.data(), M, Mp, mx.data(), row_len.data(), sum.data());
      // eb holds them by pairs of positions: word (p / 2) * Mp + j = row j's weights of p (low half)
      // and p + 1 (high), one broadcast per row and pair in the values (past a chunk's positions 0)
      for (int64_t c = 0; c < Mp; c += 8) {
        const int64_t pe = row_len[std::min(M, c + 8) - 1];
        for (int64_t p = 0; p < pe; p += 2) {
          const __m128i e0 = (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(scores.data() + p * Mp + c));
          const __m128i e1 = p + 1 < pe ? (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(scores.data() + (p + 1) * Mp + c))
                                        : _mm_setzero_si128();
          uint32_t* w = eb.data() + (p / 2) * Mp + c;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm_unpacklo_epi16(e0, e1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(w + 4), _mm_unpackhi_epi16(e0, e1));
        }
      }
      // values: per kv head, its rows (every token's G heads) RB at a time, pairs of positions
      const bool next = it + 1 < it1;
      const int64_t gn = (it + 1) / S, tn = next ? group_start[gn] : 0;
      const int64_t Ln = next ? lens[group_start[gn + 1] - 1] : 0;
      const __m512i zero = _mm512_setzero_si512();
      for (int64_t h = 0; h < k1 - k0; ++h) {
        const int64_t hr = n * G;  // rows of this head: token i, head g -> i * MT + h * G + g
        for (int64_t r0 = 0; r0 < hr; r0 += RB) {
          const int rb = static_cast<int>(std::min<int64_t>(RB, hr - r0));
          int64_t js[RB];
          for (int r = 0; r < rb; ++r) js[r] = ((r0 + r) / G) * MT + h * G + (r0 + r) % G;
          __m512 ac[RB][NV];
          for (int r = 0; r < RB; ++r)
            for (int z = 0; z < NV; ++z) ac[r][z] = _mm512_setzero_ps();
          const int64_t pe = row_len[js[rb - 1]], pall = row_len[js[0]];  // (rows in token order)
          int64_t rl[RB];
          for (int r = 0; r < rb; ++r) rl[r] = row_len[js[r]];
          for (int64_t p = 0; p < pe; p += 2) {
            if (h == 0 && r0 == 0 && next) {
              for (int64_t pn = p; pn < std::min(p + 2, Ln); ++pn) {
                const int64_t sn = (it + 1) % S, kn0 = sn * Hkv / S;
                const char* b = reinterpret_cast<const char*>(
                    kc + (tables[tn * max_blocks + pn / bs] * bs + pn % bs) * row_stride + kn0 * D);
                const int64_t spn = ((sn + 1) * Hkv / S - kn0) * D * 2;
                for (int64_t o = 0; o < spn; o += 64) _mm_prefetch(b + o, _MM_HINT_T1);
              }
            }
            const uint16_t* va = row_of(vc, p) + h * D;
            const uint16_t* vb = p + 1 < L ? row_of(vc, p + 1) + h * D : nullptr;
            __m512bh vp[NV];
            for (int z = 0; z < NQ; ++z) {
              const __m512i a = _mm512_loadu_si512(va + 32 * z), b = vb ? _mm512_loadu_si512(vb + 32 * z) : zero;
              vp[2 * z] = (__m512bh)_mm512_permutex2var_epi16(a, ilo, b);
              vp[2 * z + 1] = (__m512bh)_mm512_permutex2var_epi16(a, ihi, b);
            }
            const uint32_t* ew = eb.data() + (p / 2) * Mp;
            for (int r = 0; r < rb; ++r) {
              if (p >= pall && p >= rl[r]) continue;  // (an earlier token's row: a later token's position)
              const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(ew[js[r]]));
              for (int z = 0; z < NV; ++z) ac[r][z] = _mm512_dpbf16_ps(ac[r][z], x, vp[z]);
            }
          }
          for (int r = 0; r < rb; ++r) {
            const int64_t j = js[r];
            const __m512 inv = _mm512_set1_ps(1.0f / sum[j]);
            float* o = out + ((t0 + j / MT) * H + k0 * G + j % MT) * D;
            for (int z = 0; z < NV; ++z) _mm512_storeu_ps(o + 16 * z, _mm512_mul_ps(ac[r][z], inv));
          }
        }
      }
    }
  }
}

#pragma GCC pop_options

// attention_rows_dp for head_dim 32 * NQ, NQ in {1, 2, 4, 8}; false where it does not run.
bool attention_dp_any(const float* q, int64_t T, int64_t H, int64_t D, const uint16_t* kc, const uint16_t* vc,
                      int64_t bs, int64_t Hkv, const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                      float scale, float* out, int threads) {
  switch (D) {
    case 32: attention_rows_dp<1>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads); return true;
    case 64: attention_rows_dp<2>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads); return true;
    case 128: attention_rows_dp<4>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads); return true;
    case 256: attention_rows_dp<8>(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads); return true;
    default: return false;
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f")

// exp8's operations on 16 lanes (the same bits per lane as exp8).
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(e));
}

#pragma GCC pop_options

// ---- rows attention on AMX tiles (bfloat16 caches, blocks of a multiple of 16 positions) ------
// attention_rows_dp's work with the products on tiles: per (group of a request's tokens, range of
// kv heads), each head's R = tokens x G query rows (R <= 16; a larger group is split) against the
// context in chunks of 16 positions, the chunk's keys for up to four heads at once. Scores S = Q K^T: A = the rows of q rounded to bfloat16 (32 of D per tile),
// B = the chunk's 16 key rows transposed as pairs of k (`transpose16_epi32`; the 16 positions of
// a chunk are consecutive rows of one block), `tdpbf16ps` into S [R, 16]. Each row's softmax over
// its own positions (scaled, max, exponentials `exp8` and their float32 sum 16 lanes at a time in
// position order, then `_mm512_reduce_add_ps`), the exponentials rounded to bfloat16 as P [R, L],
// zeros past the row's context; then O = P V: A = P (32 positions a tile), B = the value rows of
// positions 2i and 2i + 1 interleaved (16 dims a tile, zeros past the group's last position),
// 16 dims at a time; the output O / sum. Each (token, head)'s operations depend on its own q, its
// positions and the cache only: a tile's output element reads its own row and column, a row's
// masked positions weigh exactly 0 against finite values, a chunk's garbage keys past the context
// (the block's unwritten rows) never reach a kept score; so the same bits alone, grouped or next
// to other requests. Not attention_rows_dp's bits (another order of the products' sums). A
// verification's 6 tokens over 230 positions 2.2x faster than attention_rows_dp, 16 requests'
// decode tokens 1.03x, one token 0.88x (the keys' transposes cost what one row's dot products do;
// `python -m bench.bench_kernels --attention`).
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

// 16 rows of 16 dwords (row i at src + i * stride bytes) -> dst[j][i] = row i's dword j.
static inline void transpose16_epi32(const char* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + 16 * j, r[j]);
}

// Tiles 0, 3, 4, 5: R rows x 16 float32 (four chunks of S, four chunks of 16 dims of O: four
// products in flight instead of a chain through one accumulator), 1: R rows x 32 bfloat16 (Q or
// P), 2 and 6: 16 x 32 bfloat16 (K^T or V).
static void amx_attention_configure(int R) {
  TileConfig c{};
  c.palette = 1;
  for (int t : {0, 1, 3, 4, 5}) c.rows[t] = static_cast<uint8_t>(R), c.colsb[t] = 64;
  for (int t : {2, 6}) c.rows[t] = 16, c.colsb[t] = 64;
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// A tree token's visible lanes among positions p .. p + 15 (tree: its (base, bits): position
// base + j is seen iff bit j; positions before base always; base < 0: every position).
static inline __mmask16 tree_lanes(const int64_t* tree, int64_t p) {
  if (tree == nullptr || tree[0] < 0 || p + 16 <= tree[0]) return 0xFFFF;
  const uint64_t bits = static_cast<uint64_t>(tree[1]);
  uint32_t m = 0;
  for (int l = 0; l < 16; ++l) {
    const int64_t j = p + l - tree[0];
    if (j < 0 || (j < 64 && ((bits >> j) & 1u))) m |= 1u << l;
  }
  return static_cast<__mmask16>(m);
}

void attention_rows_amx(const float* q, int64_t T, int64_t H, int64_t D, const uint16_t* kc, const uint16_t* vc,
                        int64_t bs, int64_t Hkv, const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                        float scale, float* out, int threads, const int64_t* tree = nullptr) {
  const int64_t G = H / Hkv, row_stride = Hkv * D, DC = D / 32, DV = D / 16;
  const int64_t per = std::max<int64_t>(1, 16 / G);  // tokens per part (R = per * G <= 16)
  const std::vector<int64_t> group_start = token_groups(T, tables, max_blocks, lens);
  std::vector<std::pair<int64_t, int64_t>> parts;  // (first token, tokens)
  for (size_t g = 0; g + 1 < group_start.size(); ++g)
    for (int64_t t0 = group_start[g]; t0 < group_start[g + 1]; t0 += per)
      parts.emplace_back(t0, std::min(per, group_start[g + 1] - t0));
  // Work items: a part and a range of kv heads (all of them unless the threads need more items,
  // as attention_rows_dp): the keys of a chunk of positions are read for every head of the range
  // together, whole cache rows in sequence, which the hardware prefetcher follows (one head's
  // 1 / Hkv of each row from a cold cache was 1.35x the dot-product kernel's decode step).
  const int64_t NP = static_cast<int64_t>(parts.size());
  int64_t S = 1;
  while (S < Hkv && threads > 1 && ((NP * S) % threads != 0 || NP * S < threads)) ++S;
  const int64_t items = NP * S;
  const int nt = (threads > 1 && items > 1) ? threads : 1;
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<uint16_t>(i), lo_idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    hi_idx[2 * i] = static_cast<uint16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<uint16_t>(48 + i);
  }
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    static thread_local std::vector<float> S_, O;
    static thread_local std::vector<uint16_t> Qb, P;
    static thread_local std::vector<const uint16_t*> kb, vb16;
    static thread_local std::vector<uint32_t> Ktv;
    alignas(64) uint16_t Vc[4 * 512];
    O.resize(16 * D), Ktv.resize(4 * (D / 32) * 256);
    uint32_t* const Kt = Ktv.data();
    int configured = -1;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const auto [t0, n] = parts[it / S];
      const int64_t s = it % S, k0 = s * Hkv / S, k1 = (s + 1) * Hkv / S, NH = k1 - k0;
      const int64_t R = n * G, L0 = lens[t0], L = lens[t0 + n - 1];
      const int64_t L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
      const int64_t* table = tables + t0 * max_blocks;
      if (configured != R) amx_attention_configure(static_cast<int>(R)), configured = static_cast<int>(R);
      // each chunk of 16 positions: consecutive rows of one block (bs % 16 == 0); pointers at head k0
      kb.resize(L16 / 16), vb16.resize(L16 / 16);
      for (int64_t c = 0; c < L16 / 16; ++c) {
        const int64_t off = (table[16 * c / bs] * bs + (16 * c) % bs) * row_stride + k0 * D;
        kb[c] = kc + off, vb16[c] = vc + off;
      }
      // Q rows of each head of the range (head hl, row r: token r / G, query head (k0 + hl) * G + r % G)
      Qb.resize(NH * R * D);
      for (int64_t hl = 0; hl < NH; ++hl)
        for (int64_t r = 0; r < R; ++r) {
          const float* qq = q + ((t0 + r / G) * H + (k0 + hl) * G + r % G) * D;
          for (int64_t d = 0; d < D; ++d) Qb[(hl * R + r) * D + d] = f32_to_bf16(qq[d]);
        }
      // scores S [NH, R, L16] (row stride L16), a chunk of 16 positions for up to four heads at
      // once (four accumulators in flight; asking for the chunk's value rows into L2 meanwhile
      // made it slower)
      S_.resize(NH * R * L16);
      for (int64_t p0 = 0; p0 < L16; p0 += 16) {
        const char* k0p = reinterpret_cast<const char*>(kb[p0 / 16]);
        for (int64_t hg = 0; hg < NH; hg += 4) {
          const int64_t nh = std::min<int64_t>(4, NH - hg);
          _tile_zero(0);
          _tile_zero(3);
          _tile_zero(4);
          _tile_zero(5);
          for (int64_t c = 0; c < DC; ++c) {
            for (int64_t j = 0; j < nh; ++j)
              transpose16_epi32(k0p + (hg + j) * D * 2 + 64 * c, row_stride * 2, Kt + (j * DC + c) * 256);
            const uint16_t* qc = Qb.data() + hg * R * D + 32 * c;
            _tile_loadd(1, qc, D * 2);
            _tile_loadd(2, Kt + (0 * DC + c) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
            if (nh > 1) {
              _tile_loadd(1, qc + R * D, D * 2);
              _tile_loadd(6, Kt + (1 * DC + c) * 256, 64);
              _tile_dpbf16ps(3, 1, 6);
            }
            if (nh > 2) {
              _tile_loadd(1, qc + 2 * R * D, D * 2);
              _tile_loadd(2, Kt + (2 * DC + c) * 256, 64);
              _tile_dpbf16ps(4, 1, 2);
            }
            if (nh > 3) {
              _tile_loadd(1, qc + 3 * R * D, D * 2);
              _tile_loadd(6, Kt + (3 * DC + c) * 256, 64);
              _tile_dpbf16ps(5, 1, 6);
            }
          }
          float* sp = S_.data() + hg * R * L16 + p0;
          _tile_stored(0, sp, L16 * 4);
          if (nh > 1) _tile_stored(3, sp + R * L16, L16 * 4);
          if (nh > 2) _tile_stored(4, sp + 2 * R * L16, L16 * 4);
          if (nh > 3) _tile_stored(5, sp + 3 * R * L16, L16 * 4);
        }
      }
      const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
      const __m512i zero = _mm512_setzero_si512();
      P.resize(R * L32);
      for (int64_t hl = 0; hl < NH; ++hl) {
        // each row's softmax over its positions [0, L0 + r / G); P [R, L32] bfloat16, zeros after
        float inv[16];
        for (int64_t r = 0; r < R; ++r) {
          const int64_t len = L0 + r / G;
          const int64_t* tr = tree ? tree + 2 * (t0 + r / G) : nullptr;  // (a tree token: its unseen nodes -inf)
          float* sr = S_.data() + (hl * R + r) * L16;
          uint16_t* pr = P.data() + r * L32;
          __m512 mx = ninf;
          int64_t p = 0;
          for (; p + 16 <= len; p += 16) {
            const __m512 v = _mm512_mask_blend_ps(tree_lanes(tr, p), ninf, _mm512_mul_ps(_mm512_loadu_ps(sr + p), vscale));
            _mm512_storeu_ps(sr + p, v);
            mx = _mm512_max_ps(mx, v);
          }
          const __mmask16 tail = static_cast<__mmask16>((1u << (len - p)) - 1u);  // (len - p < 16)
          if (tail) {
            const __m512 v = _mm512_mask_blend_ps(tail & tree_lanes(tr, p), ninf,
                                                  _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sr + p), vscale));
            _mm512_storeu_ps(sr + p, v);
            mx = _mm512_max_ps(mx, v);
          }
          const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
          __m512 total = _mm512_setzero_ps();
          const int64_t lend = tail ? p + 16 : p;
          for (p = 0; p < lend; p += 16) {  // (the tail's -inf lanes: exact zeros)
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + p), m));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + p), (__m256i)_mm512_cvtneps_pbh(e));
          }
          for (; p < L32; p += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + p), _mm256_setzero_si256());
          inv[r] = 1.0f / _mm512_reduce_add_ps(total);
        }
        // O = P V, 64 dims at a time (four accumulators) over chunks of 32 positions; each
        // chunk's values as B tiles (16 pairs of positions x 16 dims x 2: positions 2i and
        // 2i + 1 interleaved, zeros past the part's last position) made just before its products
        for (int64_t dv = 0; dv < DV; dv += 4) {
          _tile_zero(0);
          _tile_zero(3);
          _tile_zero(4);
          _tile_zero(5);
          for (int64_t p0 = 0; p0 < L32; p0 += 32) {
            for (int64_t i = 0; i < 16; ++i) {
              const int64_t p = p0 + 2 * i;
              const uint16_t* va = p < L ? vb16[p / 16] + (p % 16) * row_stride + hl * D + dv * 16 : nullptr;
              const uint16_t* vn = p + 1 < L ? vb16[p / 16] + (p % 16 + 1) * row_stride + hl * D + dv * 16 : nullptr;
              for (int64_t z = 0; z < 2; ++z) {
                const __m512i a = va ? _mm512_loadu_si512(va + 32 * z) : zero, b = vn ? _mm512_loadu_si512(vn + 32 * z) : zero;
                _mm512_storeu_si512(Vc + (2 * z) * 512 + 32 * i, _mm512_permutex2var_epi16(a, ilo, b));
                _mm512_storeu_si512(Vc + (2 * z + 1) * 512 + 32 * i, _mm512_permutex2var_epi16(a, ihi, b));
              }
            }
            _tile_loadd(1, P.data() + p0, L32 * 2);
            _tile_loadd(2, Vc, 64);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(6, Vc + 512, 64);
            _tile_dpbf16ps(3, 1, 6);
            _tile_loadd(2, Vc + 1024, 64);
            _tile_dpbf16ps(4, 1, 2);
            _tile_loadd(6, Vc + 1536, 64);
            _tile_dpbf16ps(5, 1, 6);
          }
          _tile_stored(0, O.data() + dv * 16, D * 4);
          _tile_stored(3, O.data() + dv * 16 + 16, D * 4);
          _tile_stored(4, O.data() + dv * 16 + 32, D * 4);
          _tile_stored(5, O.data() + dv * 16 + 48, D * 4);
        }
        for (int64_t r = 0; r < R; ++r) {
          float* o = out + ((t0 + r / G) * H + (k0 + hl) * G + r % G) * D;
          const __m512 iv = _mm512_set1_ps(inv[r]);
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(O.data() + r * D + d), iv));
        }
      }
    }
    if (configured >= 0) _tile_release();
  }
}

#pragma GCC pop_options

// Paged attention for a few query tokens, each over exactly its own context, in a fixed order:
// out[t, h] = sum_p softmax_p(scale * q[t, h] . k[p]) v[p] over positions p < ctx_lens[t] of the
// token's request (keys at block_tables[t, p / block_size], row p % block_size; kv head h / G).
// Scores: `dots` over D; max, exponentials and their sum in position order; the output
// accumulated in position order, then divided by the sum. Every (t, h) is one thread's work, so
// a token's output does not depend on the other tokens of the call.
// q [T, H, D] float32; k_cache, v_cache [num_blocks, block_size, Hkv, D] float32 or bfloat16;
// block_tables [T, max_blocks] int64; ctx_lens [T] int64. Returns [T, H, D] float32.
static void check_paged(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                        const torch::Tensor& ctx_lens, int64_t T, int64_t H, int64_t D, const char* fn) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), fn, ": caches [blocks, bs, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              fn, ": caches must both be float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), fn, ": caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && ctx_lens.scalar_type() == torch::kInt64,
              fn, ": block_tables and ctx_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && ctx_lens.is_contiguous(), fn, ": block_tables and ctx_lens must be contiguous");
  TORCH_CHECK(k_cache.size(3) == D && H % k_cache.size(2) == 0, fn, ": head shapes disagree");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == T && ctx_lens.size(0) == T, fn, ": one table and length per token");
  const int64_t cap = block_tables.size(1) * k_cache.size(1);
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(lens[t] >= 1 && lens[t] <= cap, fn, ": ctx_lens out of range");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t nblocks = k_cache.size(0);
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(tables[i] >= 0 && tables[i] < nblocks, fn, ": block id out of range");
  }
}

static bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// Whether attention takes the 512-bit kernel where the CPU has it (the same bits either way;
// tests turn it off to compare the two).
static bool g_wide_attention = true;

static bool set_wide_attention(bool on) {
  const bool before = g_wide_attention;
  g_wide_attention = on;
  return before;
}

// Whether bfloat16 caches may take attention_rows_dp where the CPU has AVX512-BF16: in rows_layer
// where the layer's weights are packed for dot products (SPECDECODE_CPU_BF16_DOT=0 at packing
// turns both off), in rows_attention where its caller asks; tests turn it off to compare the
// float32 kernels.
static bool g_dot_attention = true;

static bool set_amx(bool on) {
  const bool before = g_amx;
  g_amx = on;
  return before;
}

// Whether bfloat16 caches' rows attention runs on AMX tiles where it can (attention_rows_amx:
// AMX products on, dot-product attention on, head_dim 64, 128 or 256, at most 16 query heads per
// kv head, blocks of a multiple of 16 positions; default on).
static bool g_amx_attention = true;

static bool set_amx_attention(bool on) {
  const bool before = g_amx_attention;
  g_amx_attention = on;
  return before;
}

static bool set_dot_attention(bool on) {
  const bool before = g_dot_attention;
  g_dot_attention = on;
  return before;
}

// Token trees in a causal step (rows_attention, rows_layer): tree [T, 2] int64, per token (base,
// bits) or (-1, 0): a tree token at position base + i (its tree's root at base, nodes in index
// order) with causal length base + i + 1 sees positions before base and base + j iff bit j (its
// ancestors and itself; at most 64 nodes). Checked here; empty: no trees.
static const int64_t* check_tree(const torch::Tensor& tree, const torch::Tensor& ctx_lens, int64_t T, const char* fn) {
  if (!tree.defined() || tree.numel() == 0) return nullptr;
  TORCH_CHECK(tree.scalar_type() == torch::kInt64 && tree.is_contiguous() && tree.dim() == 2 && tree.size(0) == T &&
                  tree.size(1) == 2, fn, ": tree must be contiguous int64 [T, 2] (base, bits)");
  const int64_t* tr = tree.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = tr[2 * t], i = lens[t] - 1 - base;
    if (base < 0) continue;
    TORCH_CHECK(i >= 0 && i < 64 && ((static_cast<uint64_t>(tr[2 * t + 1]) >> i) & 1u) && (tr[2 * t + 1] & 1),
                fn, ": token ", t, " is node ", i, " of the tree at ", base, ": it must be one of its 64 first nodes, "
                "seeing the root and itself");
  }
  return tr;
}

// The slot tables of a step with trees (tables over the caches viewed with one slot a block):
// each token's slots of the positions it sees, in position order; (tables, lens).
static std::tuple<torch::Tensor, torch::Tensor> tree_slot_tables(const int64_t* tree, const torch::Tensor& block_tables,
                                                                 const torch::Tensor& ctx_lens, int64_t bs) {
  const int64_t T = ctx_lens.size(0), W = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(T);
  int64_t width = 1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t p = 0; p < lens[t]; ++p) {
      const int64_t j = p - tree[2 * t];
      if (tree[2 * t] < 0 || j < 0 || ((static_cast<uint64_t>(tree[2 * t + 1]) >> j) & 1u))
        rows[t].push_back(bt[t * W + p / bs] * bs + p % bs);
    }
    width = std::max<int64_t>(width, static_cast<int64_t>(rows[t].size()));
  }
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto tables = torch::zeros({T, width}, i64), out_lens = torch::empty({T}, i64);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(tables.data_ptr<int64_t>() + t * width, rows[t].data(), sizeof(int64_t) * rows[t].size());
    out_lens.data_ptr<int64_t>()[t] = static_cast<int64_t>(rows[t].size());
  }
  return {tables, out_lens};
}

// f(k, v) with the caches' rows as bfloat16 bits (uint16_t) or float32.
template <typename F>
static void on_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == torch::kBFloat16) {
    f(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  } else {
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
}

static void run_attention(const float* q, int64_t T, int64_t H, int64_t D, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& ctx_lens,
                          float scale, float* out, int threads, bool dot, const int64_t* tree = nullptr) {
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const bool wide = g_wide_attention && cpu_has_avx512();
  if (dot && k_cache.scalar_type() == torch::kBFloat16 && g_dot_attention && g_amx_attention && amx_products() &&
      D % 32 == 0 &&
      D <= 256 && D % 64 == 0 && bs % 16 == 0 && H / Hkv <= 16) {
    attention_rows_amx(q, T, H, D, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), bs, Hkv, tables, max_blocks,
                       lens, scale, out, threads, tree);
    return;
  }
  const bool dp = dot && k_cache.scalar_type() == torch::kBFloat16 && g_dot_attention && cpu_has_dot_bf16();
  if (tree != nullptr && !dp && !(wide && D % 16 == 0 && D <= 256)) {  // attention_rows: masks the unseen nodes
    on_caches(k_cache, v_cache, [&](auto kc, auto vc) {
      attention_rows(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads, tree);
    });
    return;
  }
  if (tree != nullptr) {  // the other kernels take trees as slot tables, one slot a block
    auto [slot_tables, slot_lens] = tree_slot_tables(tree, block_tables, ctx_lens, bs);
    run_attention(q, T, H, D, k_cache.view({-1, 1, Hkv, D}), v_cache.view({-1, 1, Hkv, D}), slot_tables, slot_lens,
                  scale, out, threads, dot);
    return;
  }
  if (dp && attention_dp_any(q, T, H, D, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), bs, Hkv, tables,
                       max_blocks, lens, scale, out, threads)) {
    return;
  }
  on_caches(k_cache, v_cache, [&](auto kc, auto vc) {
    attention_any(q, T, H, D, kc, vc, bs, Hkv, tables, max_blocks, lens, scale, out, threads, wide);
  });
}

torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor ctx_lens, double scale, bool dot, torch::Tensor tree) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "rows_attention: q must be float32 [T, H, D]");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  check_paged(k_cache, v_cache, block_tables, ctx_lens, T, H, D, "rows_attention");
  const int64_t* tr = check_tree(tree, ctx_lens, T, "rows_attention");
  auto out = torch::empty({T, H, D}, q.options());
  run_attention(q.data_ptr<float>(), T, H, D, k_cache, v_cache, block_tables, ctx_lens, static_cast<float>(scale),
                out.data_ptr<float>(), at::get_num_threads(), dot, tr);
  return out;
}

// One pre-norm decoder layer (attention + SwiGLU MLP) for a few tokens, every row in float32 and
// in a fixed order (the kernels above, per-row norms, rope and activation), so a token's outputs
// do not depend on the other tokens of the call; one call instead of ~20 torch ops per layer.
//   residual' = residual + x (residual empty: x);  h = rms_norm(residual') (in_norm empty: none)
//   q, k, v = h @ w_qkv.T + b_qkv (q/k per-head rms_norm if q_norm/k_norm given), rope (cos/sin
//   rows of each token's position [T, D]); k, v written at `slots` (< 0: not written) of the
//   paged caches; a = attention of each token over its ctx_lens[t] positions;
//   residual'' = residual' + a @ w_o.T + b_o; h2 = rms_norm(residual'') * post_norm;
//   g, u = h2 @ w_gate_up.T + b; out = (silu(g) * u) @ w_down.T + b_down.
// Returns (out, residual'') [T, E] float32. Weights packed (pack_rows), float32 or bfloat16 (one
// dtype); I the intermediate size; norm weights and biases float32.
// A thread's scratch floats for rows_layer, kept across calls (grown, never shrunk or zeroed).
inline float* scratch_floats(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// A pointer into that scratch with std::vector's data() spelling.
struct RowSpan {
  float* p;
  float* data() const { return p; }
};

std::tuple<torch::Tensor, torch::Tensor> rows_layer(
    torch::Tensor x, torch::Tensor residual, torch::Tensor cos, torch::Tensor sin, torch::Tensor in_norm,
    torch::Tensor post_norm, torch::Tensor w_qkv, torch::Tensor b_qkv, torch::Tensor w_o, torch::Tensor b_o,
    torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor w_gate_up, torch::Tensor b_gate_up,
    torch::Tensor w_down, torch::Tensor b_down, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
    torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
    torch::Tensor attn_in, torch::Tensor tree) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "rows_layer: x must be contiguous float32 [T, E]");
  const int64_t T = x.size(0), E = x.size(1), D = k_cache.size(3);
  const bool has_res = residual.defined() && residual.numel() > 0;
  TORCH_CHECK(!has_res || (residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat32 && residual.is_contiguous()),
              "rows_layer: residual must be like x");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(), "rows_layer: cos/sin [T, D]");
  const auto wtype = w_qkv.scalar_type();
  for (const auto* w : {&w_qkv, &w_o, &w_gate_up, &w_down}) {
    TORCH_CHECK(w->scalar_type() == wtype, "rows_layer: weights must be of one dtype");
  }
  const int64_t Q = H * D, KV = Hkv * D, QKV = Q + 2 * KV, I2 = 2 * I;
  // attn_in (optional, [T, K]): what q/k/v read instead of the normed residual stream (EAGLE-3's
  // midlayer reads [norm(embedding), norm(feature)], 2E wide); the residual stream is still x.
  const bool has_in = attn_in.defined() && attn_in.numel() > 0;
  TORCH_CHECK(!has_in || (attn_in.dim() == 2 && attn_in.size(0) == T && attn_in.scalar_type() == torch::kFloat32 &&
                          attn_in.is_contiguous()), "rows_layer: attn_in must be contiguous float32 [T, K]");
  const int64_t K_in = has_in ? attn_in.size(1) : E;
  const Packed l_qkv = check_packed(w_qkv, QKV, K_in, "rows_layer w_qkv");
  const Packed l_o = check_packed(w_o, E, Q, "rows_layer w_o");
  const Packed l_gu = check_packed(w_gate_up, I2, E, "rows_layer w_gate_up");
  const Packed l_down = check_packed(w_down, E, I, "rows_layer w_down");
  TORCH_CHECK(k_cache.size(2) == Hkv, "rows_layer: cache heads");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T && slots.is_contiguous(), "rows_layer: slots int64 [T]");
  {
    const int64_t* sl = slots.data_ptr<int64_t>(), cache_rows = k_cache.size(0) * k_cache.size(1);
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] < cache_rows, "rows_layer: slot out of range");
  }
  check_paged(k_cache, v_cache, block_tables, ctx_lens, T, H, D, "rows_layer");
  const int64_t* tree_rows = check_tree(tree, ctx_lens, T, "rows_layer");
  const float* in_w = opt_f32(in_norm, "in_norm");
  const float* post_w = opt_f32(post_norm, "post_norm");
  TORCH_CHECK(post_w != nullptr && post_norm.numel() == E, "rows_layer: post_norm [E]");
  TORCH_CHECK(!in_w || in_norm.numel() == E, "rows_layer: in_norm [E]");
  TORCH_CHECK(!(in_w && has_in), "rows_layer: in_norm and attn_in exclude each other");
  const float* bqkv = opt_f32(b_qkv, "b_qkv");
  const float* bo = opt_f32(b_o, "b_o");
  const float* bgu = opt_f32(b_gate_up, "b_gate_up");
  const float* bdown = opt_f32(b_down, "b_down");
  const float* qn = opt_f32(q_norm, "q_norm");
  const float* kn = opt_f32(k_norm, "k_norm");
  const float* cp = opt_f32(cos, "cos");
  const float* sp = opt_f32(sin, "sin");
  const float feps = static_cast<float>(eps);
  const int threads = at::get_num_threads();

  auto res_out = torch::empty({T, E}, x.options());
  auto out = torch::empty({T, E}, x.options());
  float* res = res_out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  if (has_res) {
    const float* rp = residual.data_ptr<float>();
    for (int64_t i = 0; i < T * E; ++i) res[i] = rp[i] + xp[i];
  } else {
    std::memcpy(res, xp, sizeof(float) * T * E);
  }
  // scratch rows, each written before it is read: one thread's buffer kept across calls (zeroing
  // and allocating ~140 KB a layer for a verification's 6 rows was ~2% of a step)
  const int64_t n_h = T * std::max(E, I), n_qkv = T * QKV, n_attn = T * Q, n_gu = T * I2;
  float* const scratch = scratch_floats(n_h + n_qkv + n_attn + n_gu + T * Q);
  const RowSpan h{scratch}, qkv{scratch + n_h}, attn{qkv.p + n_qkv}, gu{attn.p + n_attn}, qbuf{gu.p + n_gu};
  if (!has_in) {
    for (int64_t t = 0; t < T; ++t) {
      if (in_w) rms_norm_row(res + t * E, in_w, E, feps, h.data() + t * E);
      else std::memcpy(h.data() + t * E, res + t * E, sizeof(float) * E);
    }
  }
  auto linear = [&](const float* in, int64_t K, const torch::Tensor& w, Packed layout, int64_t N, const float* b,
                    float* y) { packed_product(in, T, K, w, layout, N, b, y, threads); };
  linear(has_in ? attn_in.data_ptr<float>() : h.data(), K_in, w_qkv, l_qkv, QKV, bqkv, qkv.data());
  const bool cache_bf16 = k_cache.scalar_type() == torch::kBFloat16;
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<float> tmp(D);
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * QKV;
    for (int64_t hh = 0; hh < H + Hkv; ++hh) {  // q heads, then k heads
      float* head = row + hh * D;
      const float* nw = hh < H ? qn : kn;
      if (nw) {
        rms_norm_row(head, nw, D, feps, tmp.data());
        std::memcpy(head, tmp.data(), sizeof(float) * D);
      }
      rope_head(head, cp + t * D, sp + t * D, D);
    }
    if (slot[t] < 0) continue;
    const float* kv[2] = {row + Q, row + Q + KV};
    torch::Tensor* caches[2] = {&k_cache, &v_cache};
    for (int c = 0; c < 2; ++c) {
      if (cache_bf16) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(caches[c]->data_ptr<at::BFloat16>()) + slot[t] * KV;
        for (int64_t i = 0; i < KV; ++i) dst[i] = f32_to_bf16(kv[c][i]);
      } else {
        std::memcpy(caches[c]->data_ptr<float>() + slot[t] * KV, kv[c], sizeof(float) * KV);
      }
    }
  }
  // queries [T, H, D] gathered out of the qkv rows
  for (int64_t t = 0; t < T; ++t) std::memcpy(qbuf.data() + t * Q, qkv.data() + t * QKV, sizeof(float) * Q);
  // dot-product attention where the layer's products are (its weights packed for them)
  run_attention(qbuf.data(), T, H, D, k_cache, v_cache, block_tables, ctx_lens, static_cast<float>(scale), attn.data(), threads,
                l_qkv != Packed::plain, tree_rows);
  linear(attn.data(), Q, w_o, l_o, E, bo, out.data_ptr<float>());
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < T * E; ++i) res[i] += op[i];
  for (int64_t t = 0; t < T; ++t) rms_norm_row(res + t * E, post_w, E, feps, h.data() + t * E);
  linear(h.data(), E, w_gate_up, l_gu, I2, bgu, gu.data());
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu.data() + t * I2;
    const float* u = g + I;
    float* a = h.data() + t * I;
    std::memcpy(a, g, sizeof(float) * I);  // silu(g) * u = g / (1 + exp(-g)) * u
    map8(a, I, [&](__m256 v, int64_t i) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
      return _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), load_tail(u + i, I - i));
    });
  }
  linear(h.data(), I, w_down, l_down, E, bdown, op);
  return {out, res_out};
}

// A stack of decoder layers run through rows_layer in one call (the target's few-token steps:
// decode, verification): the layers' tensors and KV caches are handed over once, at load,
// instead of ~27 arguments converted per layer per step. forward(x, ...) runs every layer as
// rows_layer does (the same bits) and returns the last layer's residual stream (residual + out,
// before the final norm) and, for each boundary b in aux (in layer order), the residual stream
// entering layer b (b == number of layers: the last one). slot_rows: the block tables are slot
// tables, the caches viewed with one slot per block (see rows_attention's callers). tree: token
// trees as rows_attention takes them (empty: none).
struct RowsStack {
  std::vector<std::vector<torch::Tensor>> w;  // per layer: rows_layer's 12 tensors, in its order
  std::vector<torch::Tensor> kc, vc;
  int64_t H, Hkv, I;
  double eps, scale;
  std::vector<int64_t> aux;

  RowsStack(std::vector<std::vector<torch::Tensor>> weights, std::vector<torch::Tensor> k_caches,
            std::vector<torch::Tensor> v_caches, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
            std::vector<int64_t> aux)
      : w(std::move(weights)), kc(std::move(k_caches)), vc(std::move(v_caches)), H(H), Hkv(Hkv), I(I), eps(eps),
        scale(scale), aux(std::move(aux)) {
    TORCH_CHECK(w.size() == kc.size() && kc.size() == vc.size(), "RowsStack: one set of weights and caches per layer");
    for (const auto& lw : w) TORCH_CHECK(lw.size() == 12, "RowsStack: 12 tensors per layer (rows_layer's order)");
  }

  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                                torch::Tensor slots, torch::Tensor tables,
                                                                torch::Tensor lens, bool slot_rows, torch::Tensor tree) {
    const int64_t L = static_cast<int64_t>(w.size());
    auto is_aux = [&](int64_t b) { return std::find(aux.begin(), aux.end(), b) != aux.end(); };
    torch::Tensor h = x, res, empty;
    std::vector<torch::Tensor> kept;
    for (int64_t i = 0; i < L; ++i) {
      if (is_aux(i)) kept.push_back(res.defined() ? res + h : h);
      const auto& lw = w[i];
      torch::Tensor k = kc[i], v = vc[i];
      if (slot_rows) {
        k = k.view({-1, 1, k.size(2), k.size(3)});
        v = v.view({-1, 1, v.size(2), v.size(3)});
      }
      std::tie(h, res) = rows_layer(h, res.defined() ? res : empty, cos, sin, lw[0], lw[1], lw[2], lw[3], lw[4], lw[5],
                                    lw[6], lw[7], lw[8], lw[9], lw[10], lw[11], k, v, slots, tables, lens, H, Hkv, I,
                                    eps, scale, empty, tree);
    }
    torch::Tensor last = res.defined() ? res + h : h;
    if (is_aux(L)) kept.push_back(last);
    return {last, kept};
  }

  // The model's ends, for forward_tokens: the embedding [V, E] (float32 or bfloat16), the rope
  // tables [P, D] float32 (rows by position), the final norm [E] float32; out_bf16: the model's
  // dtype is bfloat16 (its hidden rows and auxiliary features are rounded to it).
  torch::Tensor embed, rope_cos, rope_sin, final_norm;
  bool out_bf16 = false;

  void set_ends(torch::Tensor embed_, torch::Tensor cos_, torch::Tensor sin_, torch::Tensor norm_, bool bf16) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous() &&
                    (embed_.scalar_type() == torch::kFloat32 || embed_.scalar_type() == torch::kBFloat16),
                "RowsStack.set_ends: embed must be contiguous float32 or bfloat16 [V, E]");
    TORCH_CHECK(cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.scalar_type() == torch::kFloat32 &&
                    sin_.scalar_type() == torch::kFloat32 && cos_.is_contiguous() && sin_.is_contiguous(),
                "RowsStack.set_ends: rope tables must be contiguous float32 [P, D]");
    TORCH_CHECK(norm_.scalar_type() == torch::kFloat32 && norm_.is_contiguous() && norm_.numel() == embed_.size(1),
                "RowsStack.set_ends: final_norm must be contiguous float32 [E]");
    embed = embed_, rope_cos = cos_, rope_sin = sin_, final_norm = norm_, out_bf16 = bf16;
  }

  // A whole few-token step from token ids: embedding rows (widened to float32), rope rows of the
  // positions, every layer (forward), the final norm (rms_norm_row) and the model's dtype, in one
  // call. Returns (hidden [T, E], the aux streams concatenated [T, len(aux) * E] or empty), both
  // in the model's dtype: what the torch ops around forward made, one call instead of ~10 ops
  // (each paid cold caches after a step's weights went through them).
  std::tuple<torch::Tensor, torch::Tensor> forward_tokens(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
                                                          torch::Tensor tables, torch::Tensor lens, bool slot_rows,
                                                          torch::Tensor tree) {
    TORCH_CHECK(embed.defined(), "RowsStack.forward_tokens: set_ends first");
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 && ids.is_contiguous() &&
                    positions.is_contiguous() && ids.dim() == 1 && positions.sizes() == ids.sizes(),
                "RowsStack.forward_tokens: ids and positions must be contiguous int64 [T]");
    const int64_t T = ids.size(0), E = embed.size(1), V = embed.size(0), P = rope_cos.size(0), D = rope_cos.size(1);
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto x = torch::empty({T, E}, f32), cos = torch::empty({T, D}, f32), sin = torch::empty({T, D}, f32);
    const float* emb_f = embed.scalar_type() == torch::kFloat32 ? embed.data_ptr<float>() : nullptr;
    const uint16_t* emb_h = emb_f ? nullptr : reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < V, "RowsStack.forward_tokens: token id ", id[t], " out of range");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "RowsStack.forward_tokens: position ", pos[t], " beyond the rope table");
      float* xr = x.data_ptr<float>() + t * E;
      if (emb_f) std::memcpy(xr, emb_f + id[t] * E, sizeof(float) * E);
      else for (int64_t i = 0; i < E; ++i) xr[i] = bf16_to_f32(emb_h[id[t] * E + i]);
      std::memcpy(cos.data_ptr<float>() + t * D, rope_cos.data_ptr<float>() + pos[t] * D, sizeof(float) * D);
      std::memcpy(sin.data_ptr<float>() + t * D, rope_sin.data_ptr<float>() + pos[t] * D, sizeof(float) * D);
    }
    auto [last, kept] = forward(x, cos, sin, slots, tables, lens, slot_rows, tree);
    const auto out_type = out_bf16 ? torch::kBFloat16 : torch::kFloat32;
    auto hidden = torch::empty({T, E}, torch::TensorOptions().dtype(out_type));
    std::vector<float> row(E);
    const float feps = static_cast<float>(eps);
    // float32 rows [T, n] -> out (the model's dtype) at column offset col of width `width`
    auto put = [&](const float* src, int64_t n, torch::Tensor& out, int64_t width, int64_t col, int64_t t) {
      if (out_bf16) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * width + col;
        for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
      } else {
        std::memcpy(out.data_ptr<float>() + t * width + col, src, sizeof(float) * n);
      }
    };
    for (int64_t t = 0; t < T; ++t) {
      rms_norm_row(last.data_ptr<float>() + t * E, final_norm.data_ptr<float>(), E, feps, row.data());
      put(row.data(), E, hidden, E, 0, t);
    }
    torch::Tensor aux_out = torch::empty({T, 0}, torch::TensorOptions().dtype(out_type));
    if (!kept.empty()) {
      const int64_t A = static_cast<int64_t>(kept.size()) * E;
      aux_out = torch::empty({T, A}, torch::TensorOptions().dtype(out_type));
      for (int64_t a = 0; a < static_cast<int64_t>(kept.size()); ++a)
        for (int64_t t = 0; t < T; ++t) put(kept[a].data_ptr<float>() + t * E, E, aux_out, A, a * E, t);
    }
    return {hidden, aux_out};
  }
};

// Greedy chain drafting of an EAGLE-3 head in one call (engine/spec_decode/proposers/eagle3.py describes
// the head): the midlayer's catch-up forward over each request's buffered elements, then, for
// each request, num_drafts[b] greedy drafts, every forward after the first on the element (own
// output feature, token just drafted) at the next position: one call per drafting round instead
// of a Python loop of forwards and samples. Each forward is `rows_layer` on
//   x_in = [rms_norm(embed[token]) * in_ln, rms_norm(g) * hidden_norm]   (q/k/v's input, 2H)
//   x = rms_norm(g) * hidden_norm if norm_before_residual else g          (the residual stream)
// and a draft is argmax(lm_head(rms_norm(out) * final_norm)) over the draft vocabulary, mapped
// to a target id by token_ids (empty: the identity). round_bf16 rounds the output features and
// the final norm's output to bfloat16, where a bfloat16 head's torch path holds them in its dtype.
//   feats [N0, H] float32, tokens / positions / owner [N0] int64 (each request's rows together,
//   in position order); block_tables [R, W] int64 (the request's blocks: KV slots and context);
//   num_drafts [R] int64 >= 1; embed [V, H] float32 or bfloat16; norms float32 [H]; rope_cos /
//   rope_sin [P, D] float32 (rows by position); lm_head packed (pack_rows) of n_draft rows.
// Returns drafts [R, max(num_drafts)] int64 (-1 past a request's num_drafts); the head's KV of
// every element is written at its position's slot.
// Draft distribution of one sampled row over the draft vocabulary, as engine/sampler.py's
// probs_from_logits: logits / temperature, the top_k largest kept (0: all), then the smallest set
// of tokens, most probable first, whose mass reaches top_p (the most probable always kept);
// softmax over what is kept, zeros elsewhere (filtered_probs). sample_row: then the token by
// inverse CDF with u in [0, 1), as inverse_cdf_sample: the first index whose cumulative mass
// exceeds u * total, never a token of zero probability (inverse_cdf).
void filtered_probs(const float* logits, int64_t n, float temperature, int64_t top_k, float top_p, float* q) {
  std::vector<float> l(logits, logits + n);
  for (auto& v : l) v /= temperature;
  std::vector<char> keep(n, 1);
  if ((top_k > 0 && top_k < n) || top_p < 1.0f) {
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    const int64_t k = top_k > 0 ? std::min(top_k, n) : n;
    for (int64_t r = k; r < n; ++r) keep[order[r]] = 0;
    if (top_p < 1.0f) {
      double z = 0.0;
      for (int64_t r = 0; r < k; ++r) z += std::exp(double(l[order[r]]) - double(l[order[0]]));
      double before = 0.0;
      for (int64_t r = 0; r < k; ++r) {
        const double pr = std::exp(double(l[order[r]]) - double(l[order[0]])) / z;
        if (r > 0 && before >= top_p) keep[order[r]] = 0;
        before += pr;
      }
    }
  }
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) if (keep[i]) mx = std::max(mx, l[i]);
  double z = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = keep[i] ? std::exp(l[i] - mx) : 0.0f;
    z += q[i];
  }
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<float>(q[i] / z);
}

// The token of q [n] (need not be normalized) by inverse CDF with u in [0, 1), as
// engine/sampler.py's inverse_cdf_sample.
int64_t inverse_cdf(const float* q, int64_t n, float u) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += q[i];
  const double target = double(u) * total;
  double cdf = 0.0;
  int64_t last_nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (q[i] > 0.0f) last_nonzero = i;
    cdf += q[i];
    if (cdf > target && q[i] > 0.0f) return i;
  }
  return last_nonzero;
}

int64_t sample_row(const float* logits, int64_t n, float temperature, int64_t top_k, float top_p, float u,
                   float* q) {
  filtered_probs(logits, n, temperature, top_k, top_p, q);
  return inverse_cdf(q, n, u);
}

// The EAGLE-3 midlayer and LM head that draft_chain and draft_tree run (draft_chain's comment
// gives the forward): the arguments checked once (check), forward() of the midlayer over
// elements (feature row, token, RoPE position) written at slots, outputs() of some rows: their
// output features (g for the next element) and the head's logits after them.
struct Eagle3Midlayer {
  torch::Tensor embed, in_ln, hidden_norm, final_norm, post_norm, w_qkv, w_o, w_gate_up, w_down, lm_head, token_ids,
      rope_cos, rope_sin, k_cache, v_cache;
  bool norm_before_residual, round_bf16;
  int64_t n_draft, H, Hkv, I;
  double eps, scale;
  int64_t E = 0, D = 0, V = 0, P = 0;
  Packed l_head = Packed::plain;
  const int64_t* tid = nullptr;
  const float* emb_f = nullptr;
  const uint16_t* emb_h = nullptr;

  void check(int64_t E_, const char* what) {
    E = E_, D = k_cache.size(3), V = embed.size(0), P = rope_cos.size(0);
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == E && embed.is_contiguous() &&
                    (embed.scalar_type() == torch::kFloat32 || embed.scalar_type() == torch::kBFloat16),
                what, ": embed must be contiguous float32 or bfloat16 [V, H]");
    for (const auto* t : {&in_ln, &hidden_norm, &final_norm}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == E,
                  what, ": norm weights must be contiguous float32 [H]");
    }
    TORCH_CHECK(rope_cos.dim() == 2 && rope_cos.size(1) == D && rope_sin.sizes() == rope_cos.sizes() &&
                    rope_cos.scalar_type() == torch::kFloat32 && rope_sin.scalar_type() == torch::kFloat32 &&
                    rope_cos.is_contiguous() && rope_sin.is_contiguous(),
                what, ": rope_cos / rope_sin must be contiguous float32 [P, head_dim]");
    l_head = check_packed(lm_head, n_draft, E, "draft lm_head");
    const bool mapped = token_ids.defined() && token_ids.numel() > 0;
    TORCH_CHECK(!mapped || (token_ids.scalar_type() == torch::kInt64 && token_ids.is_contiguous() && token_ids.numel() == n_draft),
                what, ": token_ids must be contiguous int64 [n_draft] or empty");
    tid = mapped ? token_ids.data_ptr<int64_t>() : nullptr;
    emb_f = embed.scalar_type() == torch::kFloat32 ? embed.data_ptr<float>() : nullptr;
    emb_h = emb_f ? nullptr : reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
  }

  void round_row(float* x, int64_t n) const {
    if (round_bf16) for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
  }

  // The midlayer over elements (g rows [T, E], tok, pos) at slots; tables / lens / tree as
  // rows_layer's (slot_rows: slot tables over the caches viewed one slot a block). Returns (mlp,
  // residual).
  std::tuple<torch::Tensor, torch::Tensor> forward(const float* g, const std::vector<int64_t>& tok,
                                                   const std::vector<int64_t>& pos, torch::Tensor slots,
                                                   torch::Tensor tables, torch::Tensor lens, bool slot_rows,
                                                   torch::Tensor tree = torch::Tensor()) const {
    const int64_t T = static_cast<int64_t>(tok.size());
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto x = torch::empty({T, E}, f32), x_in = torch::empty({T, 2 * E}, f32);
    auto cos = torch::empty({T, D}, f32), sin = torch::empty({T, D}, f32);
    const float feps = static_cast<float>(eps);
    std::vector<float> e(E);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(tok[t] >= 0 && tok[t] < V, "draft: token id out of range");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "draft: position ", pos[t], " beyond the rope table");
      float* xi = x_in.data_ptr<float>() + t * 2 * E;
      for (int64_t i = 0; i < E; ++i) e[i] = emb_f ? emb_f[tok[t] * E + i] : bf16_to_f32(emb_h[tok[t] * E + i]);
      rms_norm_row(e.data(), in_ln.data_ptr<float>(), E, feps, xi);
      rms_norm_row(g + t * E, hidden_norm.data_ptr<float>(), E, feps, xi + E);
      std::memcpy(x.data_ptr<float>() + t * E, norm_before_residual ? xi + E : g + t * E, sizeof(float) * E);
      std::memcpy(cos.data_ptr<float>() + t * D, rope_cos.data_ptr<float>() + pos[t] * D, sizeof(float) * D);
      std::memcpy(sin.data_ptr<float>() + t * D, rope_sin.data_ptr<float>() + pos[t] * D, sizeof(float) * D);
    }
    torch::Tensor empty, kc = k_cache, vc = v_cache;
    if (slot_rows) {
      kc = k_cache.view({-1, 1, k_cache.size(2), D});
      vc = v_cache.view({-1, 1, v_cache.size(2), D});
    }
    return rows_layer(x, empty, cos, sin, empty, post_norm, w_qkv, empty, w_o, empty, empty, empty, w_gate_up, empty,
                      w_down, empty, kc, vc, slots, tables, lens, H, Hkv, I, eps, scale, x_in, tree);
  }

  // For forward rows `rows`: feats [M, E] (residual + mlp, the element's next g) and logits
  // [M, n_draft] of the head after them (final norm, LM head).
  void outputs(const torch::Tensor& mlp, const torch::Tensor& res, const std::vector<int64_t>& rows,
               std::vector<float>& feats, std::vector<float>& logits) const {
    const int64_t M = static_cast<int64_t>(rows.size());
    const float* mp = mlp.data_ptr<float>();
    const float* rp = res.data_ptr<float>();
    feats.assign(M * E, 0.0f);
    std::vector<float> head_in(M * E);
    for (int64_t j = 0; j < M; ++j) {
      float* f = feats.data() + j * E;
      for (int64_t i = 0; i < E; ++i) f[i] = rp[rows[j] * E + i] + mp[rows[j] * E + i];
      round_row(f, E);
      rms_norm_row(f, final_norm.data_ptr<float>(), E, static_cast<float>(eps), head_in.data() + j * E);
      round_row(head_in.data() + j * E, E);
    }
    logits.assign(M * n_draft, 0.0f);
    packed_product(head_in.data(), M, E, lm_head, l_head, n_draft, nullptr, logits.data(), at::get_num_threads());
  }
};

// The catch-up elements of draft_chain / draft_tree checked: each request's rows together, in
// request order; returns each request's last row.
static std::vector<int64_t> catch_up_rows(const torch::Tensor& feats, const torch::Tensor& tokens,
                                          const torch::Tensor& positions, const torch::Tensor& owner,
                                          const torch::Tensor& block_tables, const char* what) {
  TORCH_CHECK(feats.dim() == 2 && feats.scalar_type() == torch::kFloat32 && feats.is_contiguous(),
              what, ": feats must be contiguous float32 [N0, H]");
  const int64_t N0 = feats.size(0);
  for (const auto* t : {&tokens, &positions, &owner}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == N0,
                what, ": tokens, positions and owner must be contiguous int64 [N0]");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              what, ": block_tables must be contiguous int64 [R, W]");
  const int64_t R = block_tables.size(0);
  const int64_t* own = owner.data_ptr<int64_t>();
  std::vector<int64_t> last_row(R, -1);
  for (int64_t i = 0; i < N0; ++i) {
    TORCH_CHECK(own[i] >= 0 && own[i] < R, what, ": owner out of range");
    TORCH_CHECK(i == 0 || own[i] >= own[i - 1], what, ": each request's rows must be together, in request order");
    last_row[own[i]] = i;
  }
  for (int64_t b = 0; b < R; ++b) TORCH_CHECK(last_row[b] >= 0, what, ": request ", b, " has no rows");
  return last_row;
}

// Block-table inputs of rows_layer for causal elements (each attends to its request's positions
// up to its own): slots, tables [T, W], lens.
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> causal_tables(const std::vector<int64_t>& pos,
                                                                             const std::vector<int64_t>& own,
                                                                             const int64_t* bt, int64_t W, int64_t bs) {
  const int64_t T = static_cast<int64_t>(pos.size());
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto slots = torch::empty({T}, i64), tables = torch::empty({T, W}, i64), lens = torch::empty({T}, i64);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos[t], b = own[t];
    slots.data_ptr<int64_t>()[t] = bt[b * W + p / bs] * bs + p % bs;
    std::memcpy(tables.data_ptr<int64_t>() + t * W, bt + b * W, sizeof(int64_t) * W);
    lens.data_ptr<int64_t>()[t] = p + 1;
  }
  return {slots, tables, lens};
}

std::tuple<torch::Tensor, torch::Tensor> draft_chain(
    torch::Tensor feats, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner,
    torch::Tensor block_tables, torch::Tensor num_drafts, torch::Tensor embed, torch::Tensor in_ln,
    torch::Tensor hidden_norm, torch::Tensor final_norm, bool norm_before_residual, torch::Tensor post_norm,
    torch::Tensor w_qkv, torch::Tensor w_o, torch::Tensor w_gate_up, torch::Tensor w_down, torch::Tensor lm_head,
    int64_t n_draft, torch::Tensor token_ids, torch::Tensor rope_cos, torch::Tensor rope_sin,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
    bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms) {
  const std::vector<int64_t> last_row = catch_up_rows(feats, tokens, positions, owner, block_tables, "draft_chain");
  const int64_t N0 = feats.size(0), E = feats.size(1);
  const int64_t R = block_tables.size(0), W = block_tables.size(1), bs = k_cache.size(1);
  TORCH_CHECK(num_drafts.scalar_type() == torch::kInt64 && num_drafts.is_contiguous() && num_drafts.numel() == R,
              "draft_chain: num_drafts must be contiguous int64 [R]");
  Eagle3Midlayer m{embed, in_ln, hidden_norm, final_norm, post_norm, w_qkv, w_o, w_gate_up, w_down, lm_head, token_ids,
                   rope_cos, rope_sin, k_cache, v_cache, norm_before_residual, round_bf16, n_draft, H, Hkv, I, eps, scale};
  m.check(E, "draft_chain");
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* own = owner.data_ptr<int64_t>();
  const int64_t* nd = num_drafts.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  int64_t kmax = 0;
  for (int64_t b = 0; b < R; ++b) {
    TORCH_CHECK(nd[b] >= 1, "draft_chain: num_drafts must be >= 1");
    kmax = std::max(kmax, nd[b]);
  }
  // sampled requests: sampling [R, 3] (temperature, top_k, top_p; temperature 0: greedy) and
  // one uniform per draft, uniforms [R, kmax]; empty: every request greedy
  const bool sampled = sampling.defined() && sampling.numel() > 0;
  TORCH_CHECK(!sampled || (sampling.scalar_type() == torch::kFloat32 && sampling.is_contiguous() &&
                           sampling.dim() == 2 && sampling.size(0) == R && sampling.size(1) == 3 &&
                           uniforms.scalar_type() == torch::kFloat32 && uniforms.is_contiguous() &&
                           uniforms.dim() == 2 && uniforms.size(0) == R && uniforms.size(1) >= kmax),
              "draft_chain: sampling must be contiguous float32 [R, 3] and uniforms float32 [R, >= max(num_drafts)]");
  const float* sp = sampled ? sampling.data_ptr<float>() : nullptr;
  const float* un = sampled ? uniforms.data_ptr<float>() : nullptr;
  if (sampled) {
    for (int64_t b = 0; b < R; ++b) {
      TORCH_CHECK(sp[b * 3] >= 0.0f && sp[b * 3 + 1] >= 0.0f && sp[b * 3 + 2] > 0.0f && sp[b * 3 + 2] <= 1.0f,
                  "draft_chain: request ", b, " has temperature < 0, top_k < 0 or top_p outside (0, 1]");
    }
  }
  // every position written: its slot must be in the table and in the rope rows
  for (int64_t b = 0; b < R; ++b) {
    const int64_t end = pos[last_row[b]] + nd[b] - 1;  // the last autoregressive element's position
    TORCH_CHECK(end / bs < W && end < m.P, "draft_chain: request ", b, " needs position ", end,
                ", beyond its block table or the rope table");
  }
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto drafts = torch::full({R, kmax}, -1, i64);
  int64_t* out_tok = drafts.data_ptr<int64_t>();
  torch::Tensor probs = sampled ? torch::zeros({R, kmax, n_draft}, torch::TensorOptions().dtype(torch::kFloat32))
                                : torch::Tensor();
  // the forward's elements: (feature row, token, position, request)
  std::vector<float> g(feats.data_ptr<float>(), feats.data_ptr<float>() + N0 * E);
  std::vector<int64_t> e_tok(tok, tok + N0), e_pos(pos, pos + N0), e_own(own, own + N0);
  std::vector<float> next_g, logits;
  for (int64_t step = 0; step < kmax; ++step) {
    const int64_t T = static_cast<int64_t>(e_tok.size());
    auto [slots, tables, lens] = causal_tables(e_pos, e_own, bt, W, bs);
    auto [mlp, res] = m.forward(g.data(), e_tok, e_pos, slots, tables, lens, false);
    // the rows that draft: each request's last element of this forward
    std::vector<int64_t> rows, reqs;
    for (int64_t t = 0; t < T; ++t) {
      if (t + 1 < T && e_own[t + 1] == e_own[t]) continue;
      if (nd[e_own[t]] > step) {
        rows.push_back(t);
        reqs.push_back(e_own[t]);
      }
    }
    const int64_t M = static_cast<int64_t>(rows.size());
    m.outputs(mlp, res, rows, next_g, logits);
    std::vector<int64_t> n_tok, n_pos, n_own;
    std::vector<float> n_g;
    for (int64_t j = 0; j < M; ++j) {
      const float* l = logits.data() + j * n_draft;
      const int64_t b = reqs[j];
      int64_t best = 0;
      if (sampled && sp[b * 3] > 0.0f) {
        best = sample_row(l, n_draft, sp[b * 3], static_cast<int64_t>(sp[b * 3 + 1]), sp[b * 3 + 2], un[b * uniforms.size(1) + step],
                          probs.data_ptr<float>() + (b * kmax + step) * n_draft);
      } else {
        for (int64_t v = 1; v < n_draft; ++v) if (l[v] > l[best]) best = v;
      }
      const int64_t picked = m.tid ? m.tid[best] : best;
      out_tok[b * kmax + step] = picked;
      if (nd[b] > step + 1) {  // the element (this output, this draft) at the next position
        n_tok.push_back(picked);
        n_pos.push_back(e_pos[rows[j]] + 1);
        n_own.push_back(b);
        n_g.insert(n_g.end(), next_g.begin() + j * E, next_g.begin() + (j + 1) * E);
      }
    }
    if (n_tok.empty()) break;
    e_tok.swap(n_tok);
    e_pos.swap(n_pos);
    e_own.swap(n_own);
    g.swap(n_g);
  }
  return {drafts, probs};
}

// Dynamic trees in one call (engine/spec_decode/proposers/tree_drafting.py's grow_trees) for a drafter
// (Drafter below: the EAGLE-3 midlayer and head of draft_chain, or a draft model's RowsStack):
// the catch-up forward over each request's buffered elements (its last element is the root, at
// position r); then level by level, for each request b with depths[b] > d, the widths[b]
// candidates of depth d with the highest cumulative log-probability (ties: the earlier
// candidate) are expanded, unless their cumulative log-probability is at most the num_nodes[b]-th
// highest so far (then none of their children could be kept: the same tree with fewer rows; a
// level where no request expands ends the growth): the e-th expanded node (the root is 0) is an
// element (its token; for EAGLE-3 with its parent's output feature) at slot r + e and RoPE
// position r + d, attending to positions 0..r, its expanded ancestors and itself; its widths[b]
// children are the head's top tokens after it with log-probabilities log_softmax(logits /
// temperature) (clamped to <= 0) added to its own. Candidates of a level are ordered by their
// parent's order, then child rank. The tree keeps the num_nodes[b] candidates of depths
// 1..depths[b] with the highest cumulative log-probability (ties: the shallower, then the
// earlier), numbered in (depth, order): closed under parents. Sampled requests (sampling's
// temperature > 0) grow grow_trees' sampled trees instead: children drawn without replacement
// from the filtered draft distribution with the given uniforms (sampled_children), the frontier
// by fewest deviations, the tree in deviation order (no floor, no pruning by value). Returns
// (tokens, parents [R, N + 1] int64, cum_logprobs [R, N + 1] float32: node 0 the root (its token,
// parent -1, 0), -1 / -inf past a tree's nodes; counts [R] int64, the nodes with the root; probs
// [R, N, n_draft] float32, node i + 1's q for sampled requests, zeros for greedy ones, undefined
// without `sampling`), N = max(num_nodes).
//
// A Drafter has n_draft, tid (draft -> target ids or null), P (rope rows) and
//   roots(logits): the catch-up forward; logits [R, n_draft] after each request's last element;
//   level(req, tok, pos, parent, slots, tables, lens, slot_rows, tree, logits): one level's
//     elements (request, token, RoPE position, the expansion index of the parent) at slots, as
//     rows_layer's block tables / tree rows; logits [T, n_draft] after each.
struct TreeRequests {
  const int64_t *tok, *pos, *bt, *dep, *wid, *nn;
  int64_t N0, R, W, bs;
  std::vector<int64_t> last_row;
};

// The catch-up elements and tree sizes checked (draft_tree / stack_tree's common inputs).
static TreeRequests tree_requests(const torch::Tensor& tokens, const torch::Tensor& positions, const torch::Tensor& owner,
                                  const torch::Tensor& block_tables, const torch::Tensor& depths,
                                  const torch::Tensor& widths, const torch::Tensor& num_nodes, int64_t bs,
                                  const torch::Tensor& feats, const char* what) {
  TreeRequests q;
  torch::Tensor rows = feats.defined() ? feats : torch::empty({tokens.numel(), 0}, torch::TensorOptions().dtype(torch::kFloat32));
  q.last_row = catch_up_rows(rows, tokens, positions, owner, block_tables, what);
  q.N0 = tokens.numel(), q.R = block_tables.size(0), q.W = block_tables.size(1), q.bs = bs;
  for (const auto* t : {&depths, &widths, &num_nodes}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == q.R,
                what, ": depths, widths and num_nodes must be contiguous int64 [R]");
  }
  q.tok = tokens.data_ptr<int64_t>(), q.pos = positions.data_ptr<int64_t>(), q.bt = block_tables.data_ptr<int64_t>();
  q.dep = depths.data_ptr<int64_t>(), q.wid = widths.data_ptr<int64_t>(), q.nn = num_nodes.data_ptr<int64_t>();
  return q;
}

template <typename Drafter>
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> grow_trees_in_one_call(
    Drafter& m, const TreeRequests& req, double temperature, double min_logprob, const torch::Tensor& sampling,
    const torch::Tensor& uniforms, const char* what) {
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), what, ": temperature must be > 0");
  TORCH_CHECK(min_logprob <= 0.0, what, ": min_logprob must be <= 0 (-inf: no floor)");
  const int64_t R = req.R, W = req.W, bs = req.bs, n_draft = m.n_draft;
  const int64_t *tok = req.tok, *pos = req.pos, *bt = req.bt, *dep = req.dep, *wid = req.wid, *nn = req.nn;
  const std::vector<int64_t>& last_row = req.last_row;
  int64_t max_depth = 0, max_nodes = 0;
  std::vector<int64_t> root_pos(R);
  for (int64_t b = 0; b < R; ++b) {
    TORCH_CHECK(dep[b] >= 1 && wid[b] >= 1 && wid[b] <= n_draft && nn[b] >= 1, what, ": request ", b,
                " needs depth >= 1, 1 <= width <= the draft vocabulary and num_nodes >= 1");
    root_pos[b] = pos[last_row[b]];
    // expanded nodes: at most 1 + width * (depth - 1) with the root, at slots r .. r + that - 1
    const int64_t end = root_pos[b] + wid[b] * (dep[b] - 1);
    TORCH_CHECK(end / bs < W && root_pos[b] + dep[b] < m.P, what, ": request ", b, " needs position ", end,
                ", beyond its block table or the rope table");
    max_depth = std::max(max_depth, dep[b]);
    max_nodes = std::max(max_nodes, nn[b]);
  }
  // sampled requests: sampling [R, 3] (temperature, top_k, top_p; temperature 0: greedy) and
  // uniforms [R, U], request b's first w + (depth - 1) * w * w read in TreeUniforms' order
  // (engine/spec_decode/proposers/tree_drafting.py); empty: every request greedy
  const bool any_sampled = sampling.defined() && sampling.numel() > 0;
  TORCH_CHECK(!any_sampled || (sampling.scalar_type() == torch::kFloat32 && sampling.is_contiguous() &&
                               sampling.dim() == 2 && sampling.size(0) == R && sampling.size(1) == 3 &&
                               uniforms.scalar_type() == torch::kFloat32 && uniforms.is_contiguous() &&
                               uniforms.dim() == 2 && uniforms.size(0) == R),
              what, ": sampling must be contiguous float32 [R, 3] and uniforms float32 [R, U]");
  const float* sp = any_sampled ? sampling.data_ptr<float>() : nullptr;
  const float* un = any_sampled ? uniforms.data_ptr<float>() : nullptr;
  const int64_t U = any_sampled ? uniforms.size(1) : 0;
  std::vector<char> is_sampled(R, 0);
  for (int64_t b = 0; any_sampled && b < R; ++b) {
    TORCH_CHECK(sp[b * 3] >= 0.0f && sp[b * 3 + 1] >= 0.0f && sp[b * 3 + 2] > 0.0f && sp[b * 3 + 2] <= 1.0f,
                what, ": request ", b, " has temperature < 0, top_k < 0 or top_p outside (0, 1]");
    is_sampled[b] = sp[b * 3] > 0.0f;
    TORCH_CHECK(!is_sampled[b] || U >= wid[b] + (dep[b] - 1) * wid[b] * wid[b], what, ": request ", b,
                " needs ", wid[b] + (dep[b] - 1) * wid[b] * wid[b], " uniforms, has ", U);
  }
  auto slot_of = [&](int64_t b, int64_t p) { return bt[b * W + p / bs] * bs + p % bs; };
  const double inv_t = 1.0 / temperature;
  // a candidate: its parent (index in the previous depth's list; -1: the root), token, cumulative
  // log-probability and, once expanded, its expansion index
  // (sampled requests: cum is float32 arithmetic, as grow_trees'; dev: the non-first draws on its
  // path; q_row: the row of qs[b] it was drawn from)
  struct Cand {
    int64_t parent, token;
    double cum;
    int64_t expanded;
    int64_t dev = 0, q_row = -1;
  };
  std::vector<std::vector<std::vector<Cand>>> level(R);  // [b][depth - 1]
  std::vector<std::vector<int64_t>> exp_slot(R);         // [b]: each expanded node's slot (the root's first)
  std::vector<std::vector<float>> qs(R);                 // [b]: a sampled request's q rows, n_draft each
  std::vector<int64_t> used(R, 0);                       // [b]: the uniforms its levels have read
  // the children of request b's node after logits row l: its top widths[b] tokens
  auto children = [&](int64_t b, const float* l, int64_t parent, double parent_cum, std::vector<Cand>& out) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < n_draft; ++v) mx = std::max(mx, double(l[v]) * inv_t);
    double z = 0.0;
    for (int64_t v = 0; v < n_draft; ++v) z += std::exp(double(l[v]) * inv_t - mx);
    const double lse = mx + std::log(z);
    std::vector<int64_t> order(n_draft);
    for (int64_t v = 0; v < n_draft; ++v) order[v] = v;
    std::partial_sort(order.begin(), order.begin() + wid[b], order.end(),
                      [&](int64_t a, int64_t c) { return l[a] > l[c] || (l[a] == l[c] && a < c); });
    for (int64_t j = 0; j < wid[b]; ++j) {
      const int64_t v = order[j];
      out.push_back({parent, m.tid ? m.tid[v] : v, parent_cum + std::min(0.0, double(l[v]) * inv_t - lse), -1});
    }
  };
  // the children of sampled request b's node after logits row l: widths[b] draws without
  // replacement from q (filtered as the target's, `filtered_probs`), child j from q without
  // children 0..j-1 renormalized, by inverse CDF with u[j * u_stride]; log-probability log q of the
  // child, -inf once q ran out (tree_drafting.tree_children)
  auto sampled_children = [&](int64_t b, const float* l, int64_t parent, float parent_cum, int64_t parent_dev,
                              const float* u, int64_t u_stride, std::vector<Cand>& out) {
    std::vector<float> q(n_draft), rest(n_draft);
    filtered_probs(l, n_draft, sp[b * 3], static_cast<int64_t>(sp[b * 3 + 1]), sp[b * 3 + 2], q.data());
    rest = q;
    for (int64_t j = 0; j < wid[b]; ++j) {
      float mass = 0.0f;
      {
        double acc = 0.0;
        for (int64_t v = 0; v < n_draft; ++v) acc += rest[v];
        mass = static_cast<float>(acc);
      }
      const int64_t q_row = static_cast<int64_t>(qs[b].size() / n_draft);
      qs[b].resize(qs[b].size() + n_draft);
      float* qj = qs[b].data() + q_row * n_draft;
      for (int64_t v = 0; v < n_draft; ++v) qj[v] = rest[v] / std::max(mass, 1e-30f);
      const int64_t v = inverse_cdf(qj, n_draft, u[j * u_stride]);
      const float lp = mass > 0.0f ? std::log(q[v]) : -INFINITY;
      const float cum = parent_cum + std::min(0.0f, lp);
      out.push_back({parent, m.tid ? m.tid[v] : v, double(cum), -1, parent_dev + (j > 0), q_row});
      rest[v] = 0.0f;
    }
  };
  // the catch-up: every buffered element, causal; the root's output gives depth 1
  std::vector<float> logits;
  {
    m.roots(logits);
    for (int64_t b = 0; b < R; ++b) {
      exp_slot[b].push_back(slot_of(b, root_pos[b]));
      level[b].emplace_back();
      if (is_sampled[b]) {
        sampled_children(b, logits.data() + b * n_draft, -1, 0.0f, 0, un + b * U, 1, level[b][0]);
        used[b] = wid[b];
      } else {
        children(b, logits.data() + b * n_draft, -1, 0.0, level[b][0]);
      }
    }
  }
  // the num_nodes[b]-th highest cumulative log-probability among request b's candidates so far
  // (-inf while it has fewer): a candidate at or below it can have no child in the tree (a
  // child's is at most its parent's and a tie goes to the earlier candidate), and it only rises
  auto kept_bar = [&](int64_t b) -> double {
    std::vector<double> cums;
    for (const auto& lv : level[b])
      for (const Cand& c : lv)
        if (std::isfinite(c.cum)) cums.push_back(c.cum);
    if (static_cast<int64_t>(cums.size()) < nn[b]) return -INFINITY;
    std::nth_element(cums.begin(), cums.begin() + (nn[b] - 1), cums.end(), std::greater<double>());
    return cums[nn[b] - 1];
  };
  for (int64_t d = 1; d < max_depth; ++d) {
    // this level's elements: the frontier of every request still growing, less the nodes whose
    // children cannot be kept (the tree is the same; fewer rows and levels run)
    std::vector<int64_t> e_tok, e_pos, e_req, e_cand, e_place, e_parent;
    std::vector<int64_t> level_nodes(R, 0);  // [b]: the nodes it expands at this level
    std::vector<std::vector<int64_t>> seen;  // each element's expanded nodes it sees (the root, ancestors, itself)
    for (int64_t b = 0; b < R; ++b) {
      if (dep[b] <= d) continue;
      std::vector<Cand>& cands = level[b][d - 1];
      std::vector<int64_t> order;
      if (is_sampled[b]) {
        // the widths[b] drawn candidates of fewest deviations, then highest cumulative
        // log-probability (tree.select_frontiers' float32 score; ties: the earlier), every one
        // expanded: a sampled tree keeps by place, not value (build_sampled_trees)
        std::vector<float> score(cands.size());
        for (size_t i = 0; i < cands.size(); ++i) {
          if (!std::isfinite(cands[i].cum)) continue;
          score[i] = std::max(static_cast<float>(cands[i].cum), -1e4f) - 2e4f * static_cast<float>(cands[i].dev);
          order.push_back(static_cast<int64_t>(i));
        }
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return score[a] > score[c]; });
      } else {
        order.resize(cands.size());
        for (size_t i = 0; i < cands.size(); ++i) order[i] = static_cast<int64_t>(i);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return cands[a].cum > cands[c].cum; });
      }
      const double bar = is_sampled[b] ? -INFINITY : kept_bar(b);
      const double floor = is_sampled[b] ? -INFINITY : min_logprob;
      order.resize(std::min<size_t>(order.size(), static_cast<size_t>(wid[b])));
      std::sort(order.begin(), order.end());
      for (int64_t c : order) {
        if (!std::isfinite(cands[c].cum) || cands[c].cum <= bar || cands[c].cum < floor) continue;
        const int64_t e = static_cast<int64_t>(exp_slot[b].size());
        cands[c].expanded = e;
        exp_slot[b].push_back(slot_of(b, root_pos[b] + e));
        const Cand* parent = cands[c].parent < 0 ? nullptr : &level[b][d - 2][cands[c].parent];
        e_parent.push_back(parent ? parent->expanded : 0);
        e_tok.push_back(cands[c].token);
        e_pos.push_back(root_pos[b] + d);
        e_req.push_back(b);
        e_cand.push_back(c);
        e_place.push_back(level_nodes[b]++);
        std::vector<int64_t> ancestors{e};  // expansion indices of itself and its ancestors, the root's (0) last
        for (int64_t dd = d - 1, p = cands[c].parent; p >= 0; p = level[b][dd - 1][p].parent, --dd)
          ancestors.push_back(level[b][dd - 1][p].expanded);
        ancestors.push_back(0);
        seen.emplace_back(ancestors.rbegin(), ancestors.rend());
      }
      level[b].emplace_back();
    }
    const int64_t T = static_cast<int64_t>(e_tok.size());
    if (T == 0) break;
    // each element at slot r + e over positions 0..r and the expanded nodes it sees: as tree rows
    // over the block table (rows_attention's `tree`: the tile kernel's masked lanes, or the slot
    // tables the other kernels make of them) while the expanded nodes fit in 64 bits, else as
    // slot tables here (the same slots in the same order)
    int64_t most = 0;
    for (const auto& sn : seen) most = std::max(most, sn.back());
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    auto slots = torch::empty({T}, i64), lens = torch::empty({T}, i64);
    torch::Tensor tables, tree_rows;
    if (most < 64) {
      tables = torch::empty({T, W}, i64), tree_rows = torch::empty({T, 2}, i64);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t b = e_req[t], e = seen[t].back();
        uint64_t bits = 0;
        for (int64_t x : seen[t]) bits |= uint64_t{1} << x;
        slots.data_ptr<int64_t>()[t] = exp_slot[b][e];
        std::memcpy(tables.data_ptr<int64_t>() + t * W, bt + b * W, sizeof(int64_t) * W);
        lens.data_ptr<int64_t>()[t] = root_pos[b] + e + 1;
        tree_rows.data_ptr<int64_t>()[2 * t] = root_pos[b];
        tree_rows.data_ptr<int64_t>()[2 * t + 1] = static_cast<int64_t>(bits);
      }
    } else {
      int64_t width = 0;
      for (int64_t t = 0; t < T; ++t) width = std::max<int64_t>(width, root_pos[e_req[t]] + static_cast<int64_t>(seen[t].size()));
      tables = torch::zeros({T, width}, i64);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t b = e_req[t];
        int64_t* row = tables.data_ptr<int64_t>() + t * width;
        int64_t n = 0;
        for (int64_t p = 0; p < root_pos[b]; ++p) row[n++] = slot_of(b, p);
        for (int64_t x : seen[t]) row[n++] = exp_slot[b][x];
        slots.data_ptr<int64_t>()[t] = exp_slot[b][seen[t].back()];
        lens.data_ptr<int64_t>()[t] = n;
      }
    }
    m.level(e_req, e_tok, e_pos, e_parent, slots, tables, lens, most >= 64, tree_rows, logits);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t b = e_req[t];
      const Cand& parent = level[b][d - 1][e_cand[t]];
      if (is_sampled[b]) {  // child j of the level's node e_place[t] of level_nodes[b]: TreeUniforms' order
        sampled_children(b, logits.data() + t * n_draft, e_cand[t], static_cast<float>(parent.cum), parent.dev,
                         un + b * U + used[b] + e_place[t], level_nodes[b], level[b][d]);
      } else {
        children(b, logits.data() + t * n_draft, e_cand[t], parent.cum, level[b][d]);
      }
    }
    for (int64_t b = 0; b < R; ++b) used[b] += wid[b] * level_nodes[b];
  }
  // each request's tree: its num_nodes best candidates (EAGLE-2's reranking) of cumulative
  // log-probability at least min_logprob (a candidate below it is not expanded either: its
  // children are below it too)
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  auto out_tok = torch::full({R, max_nodes + 1}, -1, i64), out_par = torch::full({R, max_nodes + 1}, -1, i64);
  auto out_cum = torch::full({R, max_nodes + 1}, -INFINITY, torch::TensorOptions().dtype(torch::kFloat32));
  auto counts = torch::empty({R}, i64);
  torch::Tensor probs = any_sampled ? torch::zeros({R, max_nodes, n_draft}, torch::TensorOptions().dtype(torch::kFloat32))
                                    : torch::Tensor();
  for (int64_t b = 0; b < R; ++b) {
    std::vector<std::pair<int64_t, int64_t>> pool;  // (depth - 1, index)
    const int64_t levels = std::min<int64_t>(dep[b], static_cast<int64_t>(level[b].size()));
    if (is_sampled[b]) {
      // the first num_nodes[b] drawn candidates in deviation order (fewest deviations, then the
      // shallower, then the earlier) whose parent is kept (build_sampled_trees)
      std::vector<std::pair<int64_t, int64_t>> all;
      for (int64_t dd = 0; dd < levels; ++dd)
        for (size_t i = 0; i < level[b][dd].size(); ++i) all.emplace_back(dd, static_cast<int64_t>(i));
      std::stable_sort(all.begin(), all.end(), [&](const auto& a, const auto& c) {
        return level[b][a.first][a.second].dev < level[b][c.first][c.second].dev;
      });
      std::set<std::pair<int64_t, int64_t>> kept;
      for (const auto& key : all) {
        if (static_cast<int64_t>(kept.size()) >= nn[b]) break;
        const Cand& c = level[b][key.first][key.second];
        if (!std::isfinite(c.cum) || (c.parent >= 0 && !kept.count({key.first - 1, c.parent}))) continue;
        kept.insert(key);
      }
      pool.assign(kept.begin(), kept.end());
    } else {
      for (int64_t dd = 0; dd < levels; ++dd)
        for (size_t i = 0; i < level[b][dd].size(); ++i)
          if (std::isfinite(level[b][dd][i].cum) && level[b][dd][i].cum >= min_logprob)
            pool.emplace_back(dd, static_cast<int64_t>(i));
      std::stable_sort(pool.begin(), pool.end(), [&](const auto& a, const auto& c) {
        return level[b][a.first][a.second].cum > level[b][c.first][c.second].cum;
      });
      pool.resize(std::min<size_t>(pool.size(), static_cast<size_t>(nn[b])));
      std::sort(pool.begin(), pool.end());
    }
    std::map<std::pair<int64_t, int64_t>, int64_t> node_of;
    out_tok.data_ptr<int64_t>()[b * (max_nodes + 1)] = tok[last_row[b]];
    out_cum.data_ptr<float>()[b * (max_nodes + 1)] = 0.0f;
    int64_t n = 1;
    for (const auto& key : pool) {
      const Cand& c = level[b][key.first][key.second];
      const int64_t parent = c.parent < 0 ? 0 : node_of.at({key.first - 1, c.parent});
      node_of[key] = n;
      out_tok.data_ptr<int64_t>()[b * (max_nodes + 1) + n] = c.token;
      out_par.data_ptr<int64_t>()[b * (max_nodes + 1) + n] = parent;
      out_cum.data_ptr<float>()[b * (max_nodes + 1) + n] = static_cast<float>(c.cum);
      if (is_sampled[b])
        std::memcpy(probs.data_ptr<float>() + (b * max_nodes + n - 1) * n_draft, qs[b].data() + c.q_row * n_draft,
                    sizeof(float) * n_draft);
      ++n;
    }
    counts.data_ptr<int64_t>()[b] = n;
  }
  return {out_tok, out_par, out_cum, counts, probs};
}


// The EAGLE-3 midlayer and head as a Drafter: an element is (its parent's output feature, its
// token); the catch-up's elements are feats' rows.
struct Eagle3TreeDrafter {
  Eagle3Midlayer& mid;
  const torch::Tensor& feats;
  const TreeRequests& req;
  const int64_t* own;
  int64_t n_draft, P, E;
  const int64_t* tid;
  std::vector<std::vector<float>> exp_feat;  // [b]: each expanded node's output feature, E each

  void roots(std::vector<float>& logits) {
    std::vector<int64_t> e_tok(req.tok, req.tok + req.N0), e_pos(req.pos, req.pos + req.N0), e_own(own, own + req.N0);
    auto [slots, tables, lens] = causal_tables(e_pos, e_own, req.bt, req.W, req.bs);
    auto [mlp, res] = mid.forward(feats.data_ptr<float>(), e_tok, e_pos, slots, tables, lens, false);
    std::vector<float> feat;
    mid.outputs(mlp, res, req.last_row, feat, logits);
    exp_feat.assign(req.R, {});
    for (int64_t b = 0; b < req.R; ++b) exp_feat[b].assign(feat.begin() + b * E, feat.begin() + (b + 1) * E);
  }

  void level(const std::vector<int64_t>& e_req, const std::vector<int64_t>& e_tok, const std::vector<int64_t>& e_pos,
             const std::vector<int64_t>& e_parent, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
             bool slot_rows, torch::Tensor tree, std::vector<float>& logits) {
    const int64_t T = static_cast<int64_t>(e_tok.size());
    std::vector<float> g;
    for (int64_t t = 0; t < T; ++t) {
      const auto& f = exp_feat[e_req[t]];
      g.insert(g.end(), f.begin() + e_parent[t] * E, f.begin() + (e_parent[t] + 1) * E);
    }
    auto [mlp, res] = mid.forward(g.data(), e_tok, e_pos, slots, tables, lens, slot_rows, tree);
    std::vector<int64_t> rows(T);
    for (int64_t t = 0; t < T; ++t) rows[t] = t;
    std::vector<float> feat;
    mid.outputs(mlp, res, rows, feat, logits);
    for (int64_t t = 0; t < T; ++t)
      exp_feat[e_req[t]].insert(exp_feat[e_req[t]].end(), feat.begin() + t * E, feat.begin() + (t + 1) * E);
  }
};

// A draft model (its RowsStack with set_ends) and its LM head as a Drafter: an element is its
// token; logits = lm_head(the final-norm hidden row in the model's dtype, widened), as the
// torch path's DraftLMHead over forward_tokens' rows.
struct StackTreeDrafter {
  RowsStack& stack;
  const torch::Tensor& lm_head;
  Packed l_head;
  const TreeRequests& req;
  const int64_t* own;
  int64_t n_draft, P;
  const int64_t* tid;

  void logits_of(const torch::Tensor& hidden, const std::vector<int64_t>& rows, std::vector<float>& logits) const {
    const int64_t M = static_cast<int64_t>(rows.size()), E = hidden.size(1);
    torch::Tensor h = hidden.to(torch::kFloat32).contiguous();
    std::vector<float> x(M * E);
    for (int64_t j = 0; j < M; ++j) std::memcpy(x.data() + j * E, h.data_ptr<float>() + rows[j] * E, sizeof(float) * E);
    logits.assign(M * n_draft, 0.0f);
    packed_product(x.data(), M, E, lm_head, l_head, n_draft, nullptr, logits.data(), at::get_num_threads());
  }

  torch::Tensor run(const std::vector<int64_t>& tok, const std::vector<int64_t>& p, torch::Tensor slots,
                    torch::Tensor tables, torch::Tensor lens, bool slot_rows, torch::Tensor tree) {
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    auto ids = torch::from_blob(const_cast<int64_t*>(tok.data()), {static_cast<int64_t>(tok.size())}, i64).clone();
    auto positions = torch::from_blob(const_cast<int64_t*>(p.data()), {static_cast<int64_t>(p.size())}, i64).clone();
    return std::get<0>(stack.forward_tokens(ids, positions, slots, tables, lens, slot_rows,
                                            tree.defined() ? tree : torch::empty({0}, i64)));
  }

  void roots(std::vector<float>& logits) {
    std::vector<int64_t> e_tok(req.tok, req.tok + req.N0), e_pos(req.pos, req.pos + req.N0), e_own(own, own + req.N0);
    auto [slots, tables, lens] = causal_tables(e_pos, e_own, req.bt, req.W, req.bs);
    logits_of(run(e_tok, e_pos, slots, tables, lens, false, torch::Tensor()), req.last_row, logits);
  }

  void level(const std::vector<int64_t>&, const std::vector<int64_t>& e_tok, const std::vector<int64_t>& e_pos,
             const std::vector<int64_t>&, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens, bool slot_rows,
             torch::Tensor tree, std::vector<float>& logits) {
    std::vector<int64_t> rows(e_tok.size());
    for (size_t t = 0; t < rows.size(); ++t) rows[t] = static_cast<int64_t>(t);
    logits_of(run(e_tok, e_pos, slots, tables, lens, slot_rows, tree), rows, logits);
  }
};

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> draft_tree(
    torch::Tensor feats, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner,
    torch::Tensor block_tables, torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature,
    double min_logprob, torch::Tensor embed, torch::Tensor in_ln, torch::Tensor hidden_norm, torch::Tensor final_norm,
    bool norm_before_residual, torch::Tensor post_norm, torch::Tensor w_qkv, torch::Tensor w_o,
    torch::Tensor w_gate_up, torch::Tensor w_down, torch::Tensor lm_head, int64_t n_draft, torch::Tensor token_ids,
    torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor k_cache, torch::Tensor v_cache, int64_t H,
    int64_t Hkv, int64_t I, double eps, double scale, bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms) {
  const TreeRequests req = tree_requests(tokens, positions, owner, block_tables, depths, widths, num_nodes,
                                         k_cache.size(1), feats, "draft_tree");
  Eagle3Midlayer mid{embed, in_ln, hidden_norm, final_norm, post_norm, w_qkv, w_o, w_gate_up, w_down, lm_head, token_ids,
                     rope_cos, rope_sin, k_cache, v_cache, norm_before_residual, round_bf16, n_draft, H, Hkv, I, eps, scale};
  mid.check(feats.size(1), "draft_tree");
  Eagle3TreeDrafter drafter{mid, feats, req, owner.data_ptr<int64_t>(), n_draft, mid.P, feats.size(1), mid.tid, {}};
  return grow_trees_in_one_call(drafter, req, temperature, min_logprob, sampling, uniforms, "draft_tree");
}

// draft_tree for a draft model: `stack` its layers (cpu_kernels.RowsStack with set_ends: the
// embedding, rope tables and final norm), lm_head packed (pack_rows) over n_draft rows, column i
// the target token token_ids[i] (empty: i); the catch-up elements are tokens at positions.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> stack_tree(
    RowsStack& stack, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner, torch::Tensor block_tables,
    torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature, double min_logprob,
    torch::Tensor lm_head, int64_t n_draft, torch::Tensor token_ids, torch::Tensor sampling, torch::Tensor uniforms) {
  TORCH_CHECK(stack.embed.defined() && !stack.kc.empty(), "stack_tree: the stack needs its layers and set_ends");
  const TreeRequests req = tree_requests(tokens, positions, owner, block_tables, depths, widths, num_nodes,
                                         stack.kc[0].size(1), torch::Tensor(), "stack_tree");
  const Packed layout = check_packed(lm_head, n_draft, stack.embed.size(1), "stack_tree lm_head");
  const bool mapped = token_ids.defined() && token_ids.numel() > 0;
  TORCH_CHECK(!mapped || (token_ids.scalar_type() == torch::kInt64 && token_ids.is_contiguous() && token_ids.numel() == n_draft),
              "stack_tree: token_ids must be contiguous int64 [n_draft] or empty");
  StackTreeDrafter drafter{stack, lm_head, layout, req, owner.data_ptr<int64_t>(), n_draft, stack.rope_cos.size(0),
                           mapped ? token_ids.data_ptr<int64_t>() : nullptr};
  return grow_trees_in_one_call(drafter, req, temperature, min_logprob, sampling, uniforms, "stack_tree");
}

// A one-module feature drafter as a Drafter (engine/spec_decode/proposers/feature_layer.py: native MTP with one
// module, EAGLE-1): an element is (its parent's output feature, its token), its layer input
//   x = proj(cat(token_norm(embed[token]), hidden_norm(feature))) (+ proj_bias)
// (the halves swapped when hidden_first, MiMo's order; an empty norm: none, EAGLE-1's fc), the
// module's one decoder layer (a one-layer RowsStack) at rope row position + rope_offset, and its
// output feature the layer's residual stream, normed by out_norm when norm_after (MiMo), in the
// model's dtype (round_bf16); the head reads out_norm(feature) when out_norm is given and not
// norm_after (DeepSeek-V3's shared_head.norm), else the feature. The roots are given: each
// request's module output at its last final element (the catch-up ran in Python).
struct FeatureTreeDrafter {
  RowsStack& stack;
  const TreeRequests& req;
  const float* root_feats;  // [R, E]
  const float *emb_f, *token_norm, *hidden_norm, *proj_bias, *out_norm;
  const uint16_t* emb_h;
  int64_t V, E;
  bool hidden_first, norm_after, round_bf16;
  const torch::Tensor& proj;
  Packed l_proj;
  const torch::Tensor& lm_head;
  Packed l_head;
  const float *cos_t, *sin_t;
  int64_t D, rope_offset;
  float eps;
  int64_t n_draft, P;
  const int64_t* tid;
  std::vector<std::vector<float>> exp_feat;  // [b]: each expanded node's output feature, E each

  void round_row(float* x, int64_t n) const {
    if (round_bf16) for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
  }

  // logits [M, n_draft] of the head after output features feats [M, E]
  void head(const std::vector<float>& feats, int64_t M, std::vector<float>& logits) const {
    std::vector<float> in(feats);
    if (out_norm && !norm_after) {
      for (int64_t j = 0; j < M; ++j) {
        rms_norm_row(feats.data() + j * E, out_norm, E, eps, in.data() + j * E);
        round_row(in.data() + j * E, E);
      }
    }
    logits.assign(M * n_draft, 0.0f);
    packed_product(in.data(), M, E, lm_head, l_head, n_draft, nullptr, logits.data(), at::get_num_threads());
  }

  void roots(std::vector<float>& logits) {
    exp_feat.assign(req.R, {});
    std::vector<float> feats(root_feats, root_feats + req.R * E);
    for (int64_t b = 0; b < req.R; ++b) exp_feat[b].assign(feats.begin() + b * E, feats.begin() + (b + 1) * E);
    head(feats, req.R, logits);
  }

  void level(const std::vector<int64_t>& e_req, const std::vector<int64_t>& e_tok, const std::vector<int64_t>& e_pos,
             const std::vector<int64_t>& e_parent, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
             bool slot_rows, torch::Tensor tree, std::vector<float>& logits) {
    const int64_t T = static_cast<int64_t>(e_tok.size());
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto x = torch::empty({T, E}, f32), cos = torch::empty({T, D}, f32), sin = torch::empty({T, D}, f32);
    std::vector<float> cat(T * 2 * E), e(E);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(e_tok[t] >= 0 && e_tok[t] < V, "feature_tree: token id out of range");
      const float* g = exp_feat[e_req[t]].data() + e_parent[t] * E;
      for (int64_t i = 0; i < E; ++i) e[i] = emb_f ? emb_f[e_tok[t] * E + i] : bf16_to_f32(emb_h[e_tok[t] * E + i]);
      float* ep = cat.data() + t * 2 * E + (hidden_first ? E : 0);
      float* hp = cat.data() + t * 2 * E + (hidden_first ? 0 : E);
      if (token_norm) rms_norm_row(e.data(), token_norm, E, eps, ep);
      else std::memcpy(ep, e.data(), sizeof(float) * E);
      if (hidden_norm) rms_norm_row(g, hidden_norm, E, eps, hp);
      else std::memcpy(hp, g, sizeof(float) * E);
      const int64_t row = e_pos[t] + rope_offset;
      std::memcpy(cos.data_ptr<float>() + t * D, cos_t + row * D, sizeof(float) * D);
      std::memcpy(sin.data_ptr<float>() + t * D, sin_t + row * D, sizeof(float) * D);
    }
    packed_product(cat.data(), T, 2 * E, proj, l_proj, E, proj_bias, x.data_ptr<float>(), at::get_num_threads());
    auto [last, kept] = stack.forward(x, cos, sin, slots, tables, lens, slot_rows, tree);
    std::vector<float> feats(T * E);
    for (int64_t t = 0; t < T; ++t) {
      float* f = feats.data() + t * E;
      std::memcpy(f, last.data_ptr<float>() + t * E, sizeof(float) * E);
      round_row(f, E);
      if (out_norm && norm_after) {
        std::vector<float> normed(E);
        rms_norm_row(f, out_norm, E, eps, normed.data());
        std::memcpy(f, normed.data(), sizeof(float) * E);
        round_row(f, E);
      }
      exp_feat[e_req[t]].insert(exp_feat[e_req[t]].end(), f, f + E);
    }
    head(feats, T, logits);
  }
};

// draft_tree for a one-module feature drafter (FeatureTreeDrafter): `stack` the module's layer (a
// one-layer cpu_kernels.RowsStack over its KV cache), root_feats [R, E] float32 each request's
// module output at its root (the last final element, position positions[b], token tokens[b]),
// embed [V, E] float32 or bfloat16, the norms float32 [E] or empty, proj packed (pack_rows) from
// [E, 2E] with proj_bias float32 [E] or empty, rope tables [P, D] float32, lm_head packed over
// n_draft rows (column i: target token token_ids[i]; empty: i).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> feature_tree(
    RowsStack& stack, torch::Tensor root_feats, torch::Tensor tokens, torch::Tensor positions,
    torch::Tensor block_tables, torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature,
    double min_logprob, torch::Tensor embed, torch::Tensor token_norm, torch::Tensor hidden_norm, bool hidden_first,
    torch::Tensor proj, torch::Tensor proj_bias, torch::Tensor out_norm, bool norm_after, torch::Tensor lm_head,
    int64_t n_draft, torch::Tensor token_ids, torch::Tensor rope_cos, torch::Tensor rope_sin, int64_t rope_offset,
    bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms) {
  TORCH_CHECK(stack.w.size() == 1, "feature_tree: the stack must hold the module's one layer");
  TORCH_CHECK(root_feats.dim() == 2 && root_feats.scalar_type() == torch::kFloat32 && root_feats.is_contiguous(),
              "feature_tree: root_feats must be contiguous float32 [R, E]");
  const int64_t R = root_feats.size(0), E = root_feats.size(1);
  auto owner = torch::arange(R, torch::TensorOptions().dtype(torch::kInt64));
  const TreeRequests req = tree_requests(tokens, positions, owner, block_tables, depths, widths, num_nodes,
                                         stack.kc[0].size(1), root_feats, "feature_tree");
  TORCH_CHECK(req.N0 == R, "feature_tree: one root (token, position) per request");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == E && embed.is_contiguous() &&
                  (embed.scalar_type() == torch::kFloat32 || embed.scalar_type() == torch::kBFloat16),
              "feature_tree: embed must be contiguous float32 or bfloat16 [V, E]");
  auto vec = [&](const torch::Tensor& t, const char* name) -> const float* {
    if (!t.defined() || t.numel() == 0) return nullptr;
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == E, "feature_tree: ", name,
                " must be contiguous float32 [E] or empty");
    return t.data_ptr<float>();
  };
  const int64_t D = stack.kc[0].size(3);
  TORCH_CHECK(rope_cos.dim() == 2 && rope_cos.size(1) == D && rope_sin.sizes() == rope_cos.sizes() &&
                  rope_cos.scalar_type() == torch::kFloat32 && rope_sin.scalar_type() == torch::kFloat32 &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_offset >= 0,
              "feature_tree: rope_cos / rope_sin must be contiguous float32 [P, head_dim], rope_offset >= 0");
  const bool mapped = token_ids.defined() && token_ids.numel() > 0;
  TORCH_CHECK(!mapped || (token_ids.scalar_type() == torch::kInt64 && token_ids.is_contiguous() && token_ids.numel() == n_draft),
              "feature_tree: token_ids must be contiguous int64 [n_draft] or empty");
  const float* emb_f = embed.scalar_type() == torch::kFloat32 ? embed.data_ptr<float>() : nullptr;
  const uint16_t* emb_h = emb_f ? nullptr : reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
  FeatureTreeDrafter drafter{stack, req, root_feats.data_ptr<float>(), emb_f, vec(token_norm, "token_norm"),
                             vec(hidden_norm, "hidden_norm"), vec(proj_bias, "proj_bias"), vec(out_norm, "out_norm"),
                             emb_h, embed.size(0), E, hidden_first, norm_after, round_bf16, proj,
                             check_packed(proj, E, 2 * E, "feature_tree proj"), lm_head,
                             check_packed(lm_head, n_draft, E, "feature_tree lm_head"), rope_cos.data_ptr<float>(),
                             rope_sin.data_ptr<float>(), D, rope_offset, static_cast<float>(stack.eps), n_draft,
                             rope_cos.size(0) - rope_offset, mapped ? token_ids.data_ptr<int64_t>() : nullptr, {}};
  return grow_trees_in_one_call(drafter, req, temperature, min_logprob, sampling, uniforms, "feature_tree");
}

// Copy the rows at slots src onto slots dst in each paged cache ([blocks, block_size, ...],
// contiguous, one row a slot), every source read before any write: the KV moves that commit an
// accepted tree path (engine/spec_decode/tree.py move_kv), one call for every layer's caches instead of
// two torch ops per cache.
void move_slots(std::vector<torch::Tensor> caches, torch::Tensor src, torch::Tensor dst) {
  TORCH_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 && src.is_contiguous() &&
                  dst.is_contiguous() && src.dim() == 1 && dst.sizes() == src.sizes(),
              "move_slots: src and dst must be contiguous int64 [n]");
  const int64_t n = src.size(0);
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  std::vector<char> buf;
  for (const auto& c : caches) {
    TORCH_CHECK(c.is_contiguous() && c.dim() >= 2, "move_slots: caches must be contiguous [blocks, block_size, ...]");
    const int64_t slots = c.size(0) * c.size(1), row = c.numel() / std::max<int64_t>(slots, 1) * c.element_size();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < slots && dp[i] >= 0 && dp[i] < slots, "move_slots: slot out of range");
    char* base = static_cast<char*>(c.data_ptr());
    buf.resize(n * row);
    for (int64_t i = 0; i < n; ++i) std::memcpy(buf.data() + i * row, base + sp[i] * row, row);
    for (int64_t i = 0; i < n; ++i) std::memcpy(base + dp[i] * row, buf.data() + i * row, row);
  }
}

// The kernels' exp (exp8) over a float32 tensor, for its accuracy test.
torch::Tensor exp_f32(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "exp_f32: x must be float32");
  auto y = x.contiguous().clone();
  map8(y.data_ptr<float>(), y.numel(), [](__m256 v, int64_t) { return exp8(v); });
  return y;
}

// ---- Causal attention of long query chunks (prefill), AVX512-BF16 ------------------------------
// prefill_attention: each query token over its request's context up to its own position, the
// products in bfloat16 with float32 sums (`vdpbf16ps`), as torch's CPU flash attention computes
// them for bfloat16 (scores from bfloat16 q and k, float32 softmax, the probabilities rounded to
// bfloat16 for the product with v). Per work item (a request, a kv head, 16 query tokens): the
// scores of its G * 16 query rows against 32 keys at a time (16 accumulators), then each row's
// max, exponentials and sum, then the values. A row's result depends on its own q, its position
// and the cache only (scores over D in one order; max, sum and values over key positions from 0
// in one order, masked keys adding exact zeros): the same bits whatever the chunking of the
// prompt, the prefix-cache hits or the other requests of the step.
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

constexpr int64_t PF_TOKENS = 16;  // query tokens per work item
constexpr int PF_QK_ROWS = 8;      // rows per score tile (x 32 keys: 16 accumulators)
constexpr int PF_PV_ROWS = 4;      // rows per value tile (x up to 64 of D: 16 accumulators)

// Keys [0, n) of kv head hk: tile t (positions 16 t ..), pair i -> 16 uint32, lane j the pair
// (k[2 i], k[2 i + 1]) of position 16 t + j; zeros past n, up to an even number of tiles.
void pf_pack_k(const uint32_t* kc, int64_t bs, int64_t Hkv, int64_t D2, const int64_t* table, int64_t hk, int64_t n,
               uint32_t* out) {
  const int64_t tiles = (n + 31) / 32 * 2;
  std::memset(out, 0, sizeof(uint32_t) * tiles * D2 * 16);
  for (int64_t p = 0; p < n; ++p) {
    const uint32_t* row = kc + ((table[p / bs] * bs + p % bs) * Hkv + hk) * D2;
    uint32_t* dst = out + (p / 16) * D2 * 16 + p % 16;
    for (int64_t i = 0; i < D2; ++i) dst[i * 16] = row[i];
  }
}

// Values [0, n) of kv head hk: pair jp (positions 2 jp, 2 jp + 1) -> D uint32, element d the pair
// (v[2 jp][d], v[2 jp + 1][d]); the missing partner of an odd n is 0.
void pf_pack_v(const uint16_t* vc, int64_t bs, int64_t Hkv, int64_t D, const int64_t* table, int64_t hk, int64_t n,
               uint32_t* out) {
  auto row = [&](int64_t p) { return vc + ((table[p / bs] * bs + p % bs) * Hkv + hk) * D; };
  for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
    const uint16_t* a = row(2 * jp);
    uint32_t* dst = out + jp * D;
    if (2 * jp + 1 < n) {
      const uint16_t* b = row(2 * jp + 1);
      for (int64_t d = 0; d < D; ++d) dst[d] = uint32_t(a[d]) | (uint32_t(b[d]) << 16);
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = a[d];
    }
  }
}

// s[r][0..32) = scale * (q_r . k) for the 32 keys of two packed key tiles, R rows.
template <int R>
__attribute__((noinline)) void pf_scores(const uint32_t* const* q, const uint32_t* kp, int64_t D2, float scale,
                                         float* const* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* kp1 = kp + D2 * 16;
  for (int64_t i = 0; i < D2; ++i) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(kp + i * 16), b = (__m512bh)_mm512_loadu_si512(kp1 + i * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s[r], _mm512_mul_ps(acc[r][0], sc));
    _mm512_storeu_ps(s[r] + 16, _mm512_mul_ps(acc[r][1], sc));
  }
}

// acc[r][c] (16 lanes of D from d0) = sum over key pairs jp < pairs of p_r's pair jp . v's pair jp.
template <int R, int NC>
__attribute__((noinline)) void pf_values(const uint32_t* const* p, const uint32_t* vp, int64_t D, int64_t d0,
                                         int64_t pairs, float* const* out) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + d0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r][jp]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out[r] + d0 + 16 * c, acc[r][c]);
}

template <int R>
void pf_values_all(const uint32_t* const* p, const uint32_t* vp, int64_t D, int64_t pairs, float* const* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pf_values<R, 4>(p, vp, D, d0, pairs, out);
  switch ((D - d0) / 16) {
    case 3: pf_values<R, 3>(p, vp, D, d0, pairs, out); break;
    case 2: pf_values<R, 2>(p, vp, D, d0, pairs, out); break;
    case 1: pf_values<R, 1>(p, vp, D, d0, pairs, out); break;
    default: break;
  }
}

// Row softmax over keys [0, lim) of s (float32, 32-aligned length nk >= lim): p (bfloat16, the
// rounded exponentials, zeros from lim to nk) and the float32 sum of the unrounded ones.
float pf_softmax_row(float* s, int64_t lim, int64_t nk, uint16_t* p) {
  const int64_t n16 = (lim + 15) / 16 * 16;
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < n16; c += 16) {
    const int64_t live = std::min<int64_t>(16, lim - c);
    const __mmask16 k = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1u);
    const __m512 v = _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(s + c));
    _mm512_storeu_ps(s + c, v);
    m = _mm512_max_ps(m, v);
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c < n16; c += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c), mx));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (nk > n16) std::memset(p + n16, 0, sizeof(uint16_t) * (nk - n16));
  return _mm512_reduce_add_ps(total);
}

// q [T, H, D] bfloat16 (request b's query tokens at qsl[b] .. qsl[b + 1], token i at position
// seq_lens[b] - q_len + i), caches [blocks, bs, Hkv, D] bfloat16, tables [B, max_blocks].
void prefill_attention_bf16(const uint16_t* q, int64_t H, int64_t D, const uint16_t* kc, const uint16_t* vc,
                            int64_t bs, int64_t Hkv, const int64_t* qsl, const int64_t* seqs, int64_t B,
                            const int64_t* tables, int64_t max_blocks, float scale, uint16_t* out, int threads) {
  const int64_t G = H / Hkv, D2 = D / 2;
  // packed keys and values per (request, kv head)
  std::vector<int64_t> koff(B * Hkv + 1, 0), voff(B * Hkv + 1, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h) {
      koff[b * Hkv + h + 1] = koff[b * Hkv + h] + (seqs[b] + 31) / 32 * 32 * D2;
      voff[b * Hkv + h + 1] = voff[b * Hkv + h] + (seqs[b] + 31) / 32 * 16 * D;
    }
  std::vector<uint32_t> kp(koff.back()), vp(voff.back(), 0u);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv;
    pf_pack_k(reinterpret_cast<const uint32_t*>(kc), bs, Hkv, D2, tables + b * max_blocks, h, seqs[b], kp.data() + koff[bh]);
    pf_pack_v(vc, bs, Hkv, D, tables + b * max_blocks, h, seqs[b], vp.data() + voff[bh]);
  }
  // work items: (request, kv head, 16 query tokens)
  std::vector<int64_t> items;  // b, hk, first token
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < qsl[b + 1] - qsl[b]; t0 += PF_TOKENS)
      for (int64_t h = 0; h < Hkv; ++h) items.insert(items.end(), {b, h, t0});
  const int64_t n_items = static_cast<int64_t>(items.size()) / 3;
#pragma omp parallel num_threads(threads) if (threads > 1 && n_items > 1)
  {
    std::vector<float> s, acc, scratch;
    std::vector<uint16_t> p;
    std::vector<float> sums;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const int64_t b = items[3 * it], hk = items[3 * it + 1], t0 = items[3 * it + 2];
      const int64_t qlen = qsl[b + 1] - qsl[b], ctx0 = seqs[b] - qlen, t1 = std::min(qlen, t0 + PF_TOKENS);
      const int64_t rows = (t1 - t0) * G;
      const int64_t nk = (ctx0 + t1 + 31) / 32 * 32;  // keys of the item's last token, 32-aligned
      s.resize(rows * nk);
      p.resize(rows * nk);
      sums.resize(rows);
      acc.resize(rows * D);
      scratch.resize(std::max<int64_t>(32, D));
      const uint32_t* kpack = kp.data() + koff[b * Hkv + hk];
      const uint32_t* vpack = vp.data() + voff[b * Hkv + hk];
      auto q_row = [&](int64_t r) {
        return reinterpret_cast<const uint32_t*>(q + ((qsl[b] + t0 + r / G) * H + hk * G + r % G) * D);
      };
      for (int64_t r0 = 0; r0 < rows; r0 += PF_QK_ROWS) {
        const uint32_t* qs[PF_QK_ROWS];
        float* ss[PF_QK_ROWS];
        // the tile's keys: up to its last row's position
        const int64_t r1 = std::min<int64_t>(rows, r0 + PF_QK_ROWS);
        const int64_t nk_tile = (ctx0 + t0 + (r1 - 1) / G + 1 + 31) / 32 * 32;
        for (int64_t kt = 0; kt < nk_tile; kt += 32) {
          for (int i = 0; i < PF_QK_ROWS; ++i) {
            const bool live = r0 + i < rows;
            qs[i] = q_row(live ? r0 + i : rows - 1);
            ss[i] = live ? s.data() + (r0 + i) * nk + kt : scratch.data();
          }
          pf_scores<PF_QK_ROWS>(qs, kpack + (kt / 16) * D2 * 16, D2, scale, ss);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t lim = ctx0 + t0 + r / G + 1;
        sums[r] = pf_softmax_row(s.data() + r * nk, lim, nk, p.data() + r * nk);
      }
      for (int64_t r0 = 0; r0 < rows; r0 += PF_PV_ROWS) {
        const uint32_t* ps[PF_PV_ROWS];
        float* os[PF_PV_ROWS];
        const int64_t r1 = std::min<int64_t>(rows, r0 + PF_PV_ROWS);
        const int64_t pairs = (ctx0 + t0 + (r1 - 1) / G + 1 + 1) / 2;
        for (int i = 0; i < PF_PV_ROWS; ++i) {
          const bool live = r0 + i < rows;
          ps[i] = reinterpret_cast<const uint32_t*>(p.data() + (live ? r0 + i : rows - 1) * nk);
          os[i] = live ? acc.data() + (r0 + i) * D : scratch.data();
        }
        pf_values_all<PF_PV_ROWS>(ps, vpack, D, pairs, os);
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* o = out + ((qsl[b] + t0 + r / G) * H + hk * G + r % G) * D;
        const float l = sums[r];
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[r * D + d] / l);
      }
    }
  }
}

#pragma GCC pop_options


}  // namespace

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                                double scale) {
  TORCH_CHECK(cpu_has_dot_bf16(), "prefill_attention: needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16, "prefill_attention: q must be bfloat16 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "prefill_attention: caches must be bfloat16");
  q = q.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), B = seq_lens.size(0);
  TORCH_CHECK(D % 16 == 0, "prefill_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64 &&
                  block_tables.scalar_type() == torch::kInt64,
              "prefill_attention: query_start_loc, seq_lens and block_tables must be int64");
  TORCH_CHECK(query_start_loc.numel() == B + 1 && block_tables.dim() == 2 && block_tables.size(0) == B,
              "prefill_attention: query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks]");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* seqs = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "prefill_attention: query_start_loc must run from 0 to T");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qsl[b + 1] > qsl[b] && seqs[b] >= qsl[b + 1] - qsl[b], "prefill_attention: need 1 <= q_len <= seq_len");
  }
  check_paged(k_cache, v_cache, block_tables, seq_lens, B, H, D, "prefill_attention");
  auto out = torch::empty({T, H, D}, q.options());
  prefill_attention_bf16(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), H, D,
                         reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), k_cache.size(1),
                         k_cache.size(2), qsl, seqs, B, block_tables.data_ptr<int64_t>(), block_tables.size(1),
                         static_cast<float>(scale), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                         at::get_num_threads());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they run without the GIL, so the replica's other Python
  // threads (Ray Serve's event loops, gRPC, metrics) run on another core meanwhile instead of
  // waiting for a decoder layer, and the engine thread never waits for them to hand the GIL back.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("rows_linear", &rows_linear, "row-invariant small-batch x @ w.T + b (AVX2/FMA, plain packing)", nogil());
  m.def("rows_attention", &rows_attention, "row-invariant paged attention of a few query tokens (AVX2/FMA)", nogil());
  m.def("pack_rows", &pack_rows, "weights [N, K] -> the packed layout of packed_linear / rows_layer",
        py::arg("w"), py::arg("dot_bf16") = false, nogil());
  m.def("pack_rows_int8", &pack_rows_int8, "weights [N, K] -> int8 with a scale per row (a drafter's products)",
        nogil());
  m.def("pack_rows_int4", &pack_rows_int4,
        "weights [N, K] (K % 32 == 0) -> int4 with a bfloat16 scale per row and group of 32 k (a drafter's products)",
        nogil());
  m.def("has_vnni", &cpu_has_vnni, "whether this CPU runs the int8 products (AVX512-VNNI)");
  m.def("exp_f32", &exp_f32, "the kernels' vectorized exp (softmax, SiLU), element-wise", nogil());
  m.def("set_amx_attention", &set_amx_attention,
        "bfloat16 caches' rows attention on AMX tiles where it can run (default on; other bits than the dot-product "
        "kernel: never switch while an engine runs); returns the previous setting");
  m.def("set_dot_attention", &set_dot_attention,
        "bfloat16 caches' attention by AVX512-BF16 dot products where the CPU has them (default on); returns the previous setting");
  m.def("set_wide_attention", &set_wide_attention,
        "use the 512-bit attention kernel where the CPU has AVX-512 (default on; the same bits as the 256-bit one); "
        "returns the previous setting");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL (the 512-bit attention kernel)");
  m.def("has_amx", &cpu_has_amx_bf16, "whether this CPU (and the OS) run the dp-packed products on AMX tiles");
  m.def("amx_on", &amx_products, "whether the dp-packed products run on AMX tiles now (has_amx and set_amx)");
  m.def("set_amx", &set_amx,
        "run the dp-packed products on AMX tiles where the CPU has them (default on; other bits than vdpbf16ps); "
        "returns the previous setting");
  m.def("has_dot_bf16", &cpu_has_dot_bf16, "whether this CPU runs the AVX512-BF16 products (dot_bf16 layout)");
  m.def("packed_linear", &packed_linear, "rows_linear with packed weights (bit-identical results)", nogil());
  m.def("packed_linear_rows", &packed_linear_rows, "packed_linear over some rows of x (float32 or bfloat16), no bias",
        nogil());
  m.def("rows_layer", &rows_layer, "one row-invariant pre-norm decoder layer for a few tokens (AVX2/FMA)", nogil());
  py::class_<RowsStack>(m, "RowsStack", py::module_local())  // (two builds of this file can be loaded at once)
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    int64_t, int64_t, int64_t, double, double, std::vector<int64_t>>())
      .def("set_ends", &RowsStack::set_ends, "the embedding, rope tables and final norm forward_tokens uses")
      .def("forward_tokens", &RowsStack::forward_tokens,
           "a few-token step from token ids to final-norm hidden rows (and aux features), model dtype", nogil())
      .def("forward", &RowsStack::forward, "every layer through rows_layer: (last residual stream, aux streams)", nogil());
  m.def("prefill_attention", &prefill_attention,
        "causal paged attention of long query chunks (prefill), bfloat16, AVX512-BF16; row-invariant", nogil());
  m.def("draft_chain", &draft_chain, "chain drafting of an EAGLE-3 head (greedy or sampled): catch-up and every draft in one call",
        nogil());
  m.def("move_slots", &move_slots, "copy rows between slots of paged caches (sources read first)", nogil());
  m.def("stack_tree", &stack_tree, "draft_tree for a draft model's RowsStack and LM head", nogil());
  m.def("feature_tree", &feature_tree, "draft_tree for a one-module feature drafter (native MTP, EAGLE-1)", nogil());
  m.def("draft_tree", &draft_tree, "dynamic trees (greedy or sampled) of an EAGLE-3 head: catch-up and every level in one call",
        nogil());
}
