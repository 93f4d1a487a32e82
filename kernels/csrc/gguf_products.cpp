// Products over a GGUF file's block-quantized weights as they are stored (Q4_0, Q4_1, Q8_0):
// y = x @ w.T (+ b) with w dequantized in registers, so a target served from such a file streams
// its 4.5-8.5 bits a weight instead of bfloat16's 16. The target's own weights: the products are
// within float rounding of the dequantized model's (the activations' quantization below is finer
// than a bfloat16 rounding), and they keep cpu_kernels.h's row exactness.
//
// The formats (llama.cpp's ggml-common.h), per row and block of 32 k: Q4_0: a float16 scale d and
// 32 nibbles q, w = d * (q - 8); Q4_1: d, a float16 minimum m and 32 nibbles, w = d * q + m;
// Q8_0: d and 32 int8 q, w = d * q. Q4_0 is packed as Q4_1 with m = -8 d (exact in float16).
//
// The activations of each row are quantized per group of 32 k to int16 with one float32 scale
// per group (s = max |x| / 32767 over the group, round to nearest): per-group scales keep the
// groups next to an outlier channel (a down projection's inputs reach 1e3 times their median)
// as precise as the others. Per group g, one integer sum of x * q over its 32 k (`vpdpwssd`, or
// `vpmaddwd` plus an add on AVX2; exact in int32: |sum| <= 32 * 32767 * 128 < 2^31), then
//   Q4: v = float(sum) * d + float(sum_k x) * m,   Q8: v = float(sum) * d,
//   y += v * s_g   (in g order; then y (+ b)).
// Every output's operations depend on its row of x and its weights only, never on M, on the rows
// computed with it or on the thread; the 512-bit and 256-bit kernels do the same integer sums and
// the same float operations in the same order per output, so they give the same bits.
//
// Packed layout, blocks of 64 output rows (rows past N are zeros), one record per group of 32 k:
//   Q4 (1280 bytes): for each of the 16 pairs of k (k, k + 1), 64 bytes: byte b < 32 holds rows
//      b / 2 (low nibble) and 16 + b / 2 (high), byte 32 + b rows 32 + b / 2 and 48 + b / 2, k +
//      b % 2 (pack_rows_int4's arrangement, q unsigned); then the 64 rows' d, then their m
//      (float16): [ceil(N / 64), K / 32, 1280] uint8, 5 bits a weight.
//   Q8 (2176 bytes): for each pair, the 64 rows' (k, k + 1) int8 side by side (128 bytes); then
//      the 64 rows' d (float16): [ceil(N / 64), K / 32, 2176] uint8, 8.5 bits a weight.
// (Three dimensions, where the int4 and int8 layouts have two: the layouts are told apart by shape.)
// Q4 records viewed as int8 (Packed::gguf_q4_a8) are the same bytes, multiplied with activations
// quantized to int8 per half group of 16 instead (`dots_256_i8`; llama.cpp's AVX2 scheme, with
// half its groups): twice the multiply-adds an AVX2 instruction, at up to 0.4% of a half group's
// largest activation in error.
// A step streams each block's records in order, one sequential read.
#include "cpu_kernels.h"

#include <c10/util/Half.h>

namespace cpu_kernels {
namespace {

constexpr int64_t GROUP = 32, PAIRS = GROUP / 2;
constexpr int64_t Q4_RECORD = PAIRS * 64 + VN * 4, Q8_RECORD = PAIRS * 128 + VN * 2;
// Rows of x per pass over a block (ROWS_512 at most: 24 int32 accumulators, the weights' and x's
// registers). For Q4, GCC spills accumulators to the stack every pair at 4 and 5 rows (objdump:
// 127 and 496 stack references in the unrolled body, none at 1-3 and 6): those take 3 + 1 and 3 + 2.
constexpr int ROWS_512 = 6;
inline int64_t rows_512(bool q4, int64_t left) {
  if (!q4 || left <= 3 || left >= 6) return std::min<int64_t>(ROWS_512, left);
  return 3;
}

inline int64_t q4_row_bytes(int64_t K) { return K / GROUP * Q4_RECORD; }
inline int64_t q8_row_bytes(int64_t K) { return K / GROUP * Q8_RECORD; }

bool g_avx512 = true;
// Rows of x per pass of dots_256_i8 (2 accumulators a row; at most ROWS_512, the buffers' size).
constexpr int ROWS_I8 = 4;

inline uint16_t half_bits(float f) { return c10::Half(f).x; }
inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// One block of nb <= 64 rows of raw GGUF blocks (row r at raw + r * raw_row) -> records.
void pack_block_q4(const uint8_t* raw, int64_t raw_row, bool has_min, int64_t nb, int64_t K, uint8_t* dst) {
  const int64_t block_bytes = has_min ? 20 : 18;
  for (int64_t g = 0; g < K / GROUP; ++g) {
    uint8_t* rec = dst + g * Q4_RECORD;
    std::memset(rec, 0, Q4_RECORD);
    uint16_t* d = reinterpret_cast<uint16_t*>(rec + PAIRS * 64);
    uint16_t* m = d + VN;
    for (int64_t r = 0; r < nb; ++r) {
      const uint8_t* b = raw + r * raw_row + g * block_bytes;
      std::memcpy(&d[r], b, 2);
      if (has_min) std::memcpy(&m[r], b + 2, 2);
      else m[r] = half_bits(-8.0f * half_value(d[r]));
      const uint8_t* qs = b + (has_min ? 4 : 2);
      for (int64_t k = 0; k < GROUP; ++k) {
        const uint8_t q = k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);  // element k: byte k % 16's low / high nibble
        uint8_t& byte = rec[(k / 2) * 64 + (r / 32) * 32 + (r % 16) * 2 + k % 2];
        byte = (r % 32) < 16 ? static_cast<uint8_t>((byte & 0xF0) | q) : static_cast<uint8_t>((byte & 0x0F) | (q << 4));
      }
    }
  }
}

void pack_block_q8(const uint8_t* raw, int64_t raw_row, int64_t nb, int64_t K, uint8_t* dst) {
  for (int64_t g = 0; g < K / GROUP; ++g) {
    uint8_t* rec = dst + g * Q8_RECORD;
    std::memset(rec, 0, Q8_RECORD);
    uint16_t* d = reinterpret_cast<uint16_t*>(rec + PAIRS * 128);
    for (int64_t r = 0; r < nb; ++r) {
      const uint8_t* b = raw + r * raw_row + g * 34;
      std::memcpy(&d[r], b, 2);
      for (int64_t k = 0; k < GROUP; ++k) rec[(k / 2) * 128 + r * 2 + k % 2] = b[2 + k];
    }
  }
}

// x [M, K] float32 -> int16 per group of 32 (xq [M, K]), the groups' scales (xs [M, K / 32]) and
// their sums of xq (xsum, as float: exact, |sum| < 2^21). q = round-to-nearest-even(x / s) in
// IEEE float32, as np.rint(x / s) gives it (tests/test_gguf_products.py).
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// The largest |v| over n registers of 8.
inline float max_abs(const __m256* v, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// round-to-nearest-even(v / s), clamped to [-lim, lim], as int32 lanes.
inline __m256i quantize_lanes(__m256 v, __m256 s, __m256 lim) {
  const __m256 r = _mm256_round_ps(_mm256_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), _mm256_min_ps(r, lim)));
}

void quantize_groups(const float* x, int64_t M, int64_t K, std::vector<int16_t>& xq, std::vector<float>& xs,
                     std::vector<float>& xsum) {
  const int64_t KG = K / GROUP;
  xq.resize(M * K);
  xs.resize(M * KG);
  xsum.resize(M * KG);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < KG; ++g) {
      const float* xg = x + m * K + g * GROUP;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
      const float amax = max_abs(v, 4);
      int16_t* q = xq.data() + m * K + g * GROUP;
      if (amax == 0.0f) {
        std::memset(q, 0, sizeof(int16_t) * GROUP);
        xs[m * KG + g] = xsum[m * KG + g] = 0.0f;
        continue;
      }
      const float s = amax / 32767.0f;
      const __m256 sv = _mm256_set1_ps(s), lim = _mm256_set1_ps(32767.0f);
      __m256i acc = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256i qi = quantize_lanes(v[i], sv, lim);
        acc = _mm256_add_epi32(acc, qi);
        // 8 int32 -> 8 int16 (in range: no saturation), in order
        const __m128i lo = _mm256_castsi256_si128(qi), hi = _mm256_extracti128_si256(qi, 1);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8 * i), _mm_packs_epi32(lo, hi));
      }
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      xs[m * KG + g] = s;
      xsum[m * KG + g] = static_cast<float>(_mm_cvtsi128_si32(t));
    }
}

// int8 activations for `dots_256_i8` (Packed::gguf_q4_a8): each half group of 16 k its own
// scale (s = max |x| / 127 over the 16, round to nearest even): an outlier channel coarsens 15
// neighbours rather than 31. xq [M, K] int8, xs [M, K / 16] the scales, xsum [M, K / 32] per group
// the scaled sum of q over its halves, float(sum_1) * s_1 + float(sum_2) * s_2 (the Q4_1 minimum's
// term). llama.cpp's AVX2 Q4 products take int8 activations per group of 32.
void quantize_groups_i8(const float* x, int64_t M, int64_t K, std::vector<int8_t>& xq, std::vector<float>& xs,
                        std::vector<float>& xsum) {
  constexpr int64_t HALF = GROUP / 2;
  const int64_t KG = K / GROUP, KH = K / HALF;
  xq.resize(M * K);
  xs.resize(M * KH);
  xsum.resize(M * KG);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < KG; ++g) {
      float t = 0.0f;
      for (int64_t hh = 0; hh < 2; ++hh) {
        const int64_t hi = g * 2 + hh;
        const float* xg = x + m * K + hi * HALF;
        __m256 v[2];
        for (int i = 0; i < 2; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
        const float amax = max_abs(v, 2);
        int8_t* q = xq.data() + m * K + hi * HALF;
        if (amax == 0.0f) {
          std::memset(q, 0, HALF);
          xs[m * KH + hi] = 0.0f;
          continue;
        }
        const float sc = amax / 127.0f;
        const __m256 sv = _mm256_set1_ps(sc), lim = _mm256_set1_ps(127.0f);
        int32_t total = 0;
        for (int i = 0; i < 2; ++i) {
          const __m256i qi = quantize_lanes(v[i], sv, lim);
          alignas(32) int32_t lanes[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), qi);
          for (int j = 0; j < 8; ++j) q[8 * i + j] = static_cast<int8_t>(lanes[j]), total += lanes[j];
        }
        xs[m * KH + hi] = sc;
        t = hh ? t + static_cast<float>(total) * sc : static_cast<float>(total) * sc;
      }
      xsum[m * KG + g] = t;
    }
}

#pragma GCC pop_options

// ---- 512-bit kernels (AVX512-VNNI) --------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// MB rows x[m] (int16 [K]) against one block: out[m][n] = sum over groups of v * s_g (Q4 or Q8).
template <int MB, bool Q4>
__attribute__((noinline)) void dots_512(const int16_t* const* x, const float* const* xs, const float* const* xsum,
                                        const uint8_t* p, int64_t KG, float (*out)[VN]) {
  const __m512i low = _mm512_set1_epi16(0x0F);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < VZ; ++j) _mm512_store_ps(out[m] + 16 * j, _mm512_setzero_ps());
  for (int64_t g = 0; g < KG; ++g) {
    __m512i a[MB][VZ];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < VZ; ++j) a[m][j] = _mm512_setzero_si512();
    // unrolled: a rolled loop keeps the accumulators in rotating registers and spills them
#pragma GCC unroll 16
    for (int64_t s = 0; s < PAIRS; ++s) {
      const int64_t k = g * GROUP + 2 * s;
      __m512i xv[MB];
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x[m] + k, sizeof(pair));
        xv[m] = _mm512_set1_epi32(pair);
      }
      if constexpr (Q4) {
        // half a pair's weights at a time (rows 0-31, then 32-63): two weight registers live
        for (int h = 0; h < 2; ++h) {
          const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)));
          const __m512i lo = _mm512_and_si512(u, low), hi = _mm512_srli_epi16(u, 4);
          for (int m = 0; m < MB; ++m) {
            a[m][2 * h] = _mm512_dpwssd_epi32(a[m][2 * h], xv[m], lo);
            a[m][2 * h + 1] = _mm512_dpwssd_epi32(a[m][2 * h + 1], xv[m], hi);
          }
        }
        p += 64;
      } else {
        for (int j = 0; j < VZ; ++j) {
          const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
          for (int m = 0; m < MB; ++m) a[m][j] = _mm512_dpwssd_epi32(a[m][j], xv[m], w);
        }
        p += 128;
      }
    }
    __m512 d[VZ], mn[VZ];
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(p);
    for (int j = 0; j < VZ; ++j) {
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * j)));
      if constexpr (Q4) mn[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + VN + 16 * j)));
    }
    p += Q4 ? VN * 4 : VN * 2;
    for (int m = 0; m < MB; ++m) {
      const __m512 s = _mm512_set1_ps(xs[m][g]);
      const __m512 xsm = _mm512_set1_ps(xsum[m][g]);
      for (int j = 0; j < VZ; ++j) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a[m][j]), d[j]);
        if constexpr (Q4) v = _mm512_fmadd_ps(xsm, mn[j], v);
        _mm512_store_ps(out[m] + 16 * j, _mm512_fmadd_ps(v, s, _mm512_load_ps(out[m] + 16 * j)));
      }
    }
  }
}

#pragma GCC pop_options

template <bool Q4>
void dots_512_rows(int rows, const int16_t* const* x, const float* const* xs, const float* const* xsum, const uint8_t* p,
                   int64_t KG, float (*out)[VN]) {
  switch (rows) {
    case 6: dots_512<6, Q4>(x, xs, xsum, p, KG, out); break;
    case 5: dots_512<5, Q4>(x, xs, xsum, p, KG, out); break;
    case 4: dots_512<4, Q4>(x, xs, xsum, p, KG, out); break;
    case 3: dots_512<3, Q4>(x, xs, xsum, p, KG, out); break;
    case 2: dots_512<2, Q4>(x, xs, xsum, p, KG, out); break;
    default: dots_512<1, Q4>(x, xs, xsum, p, KG, out); break;
  }
}

// ---- 256-bit kernels (AVX2, FMA, F16C): one row of x per pass, the same bits ------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Register r (of 8) holds rows 8r .. 8r + 7. Q4: the 16-byte chunk c of a pair's 64 bytes holds,
// as low nibbles, rows 32 (c / 2) + 8 (c % 2) + 0..7 and, as high nibbles, those + 16.
template <bool Q4>
__attribute__((noinline)) void dots_256(const int16_t* x, const float* xs, const float* xsum, const uint8_t* p,
                                        int64_t KG, float* out) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_setzero_ps());
  for (int64_t g = 0; g < KG; ++g) {
    __m256i a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_si256();
    for (int64_t s = 0; s < PAIRS; ++s) {
      int32_t pair;
      std::memcpy(&pair, x + g * GROUP + 2 * s, sizeof(pair));
      const __m256i xv = _mm256_set1_epi32(pair);
      if constexpr (Q4) {
        for (int c = 0; c < 4; ++c) {
          const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
          const int r = (c / 2) * 4 + c % 2;
          a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(xv, _mm256_and_si256(u, low)));
          a[r + 2] = _mm256_add_epi32(a[r + 2], _mm256_madd_epi16(xv, _mm256_srli_epi16(u, 4)));
        }
        p += 64;
      } else {
        for (int r = 0; r < 8; ++r) {
          const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * r)));
          a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(xv, w));
        }
        p += 128;
      }
    }
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(p);
    const __m256 s = _mm256_set1_ps(xs[g]);
    const __m256 xsm = _mm256_set1_ps(xsum[g]);
    for (int r = 0; r < 8; ++r) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * r)));
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(a[r]), d);
      if constexpr (Q4)
        v = _mm256_fmadd_ps(xsm, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + VN + 8 * r))), v);
      _mm256_storeu_ps(out + 8 * r, _mm256_fmadd_ps(v, s, _mm256_loadu_ps(out + 8 * r)));
    }
    p += Q4 ? VN * 4 : VN * 2;
  }
}

// Q4 blocks against MB rows of int8 activations (quantize_groups_i8), `vpmaddubsw`: the nibbles
// (unsigned) times a pair of x's bytes, two products a 16-bit lane, 32 a register where
// `vpmaddwd` makes 16: twice the multiply-adds an instruction, the rate AVX2 decode and
// verification are bound by. A pair's 32 bytes of a half block, masked, give rows 32 h + 0..15
// (low nibbles) and 32 h + 16..31 (high), each lane (k, k + 1) of one row. The 16-bit sums are
// exact over the 8 pairs of a half group (|sum| <= 8 * 2 * 15 * 127 < 2^15), each scaled by its
// half's activation scale: per group v = (float(sum_1) * s_1 + float(sum_2) * s_2) * d + t * m.
template <int MB>
__attribute__((noinline)) void dots_256_i8(const int8_t* const* x, const float* const* xs, const float* const* xsum,
                                           const uint8_t* p, int64_t KG, float (*out)[VN]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out[m] + 8 * r, _mm256_setzero_ps());
  for (int64_t g = 0; g < KG; ++g, p += Q4_RECORD) {
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(p + PAIRS * 64);
    for (int h = 0; h < 2; ++h) {
      alignas(32) float sum[MB][32];
      for (int half = 0; half < 2; ++half) {
        __m256i a[MB][2];
        for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int64_t s = 8 * half; s < 8 * half + 8; ++s) {
          const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * 64 + 32 * h));
          const __m256i w0 = _mm256_and_si256(u, low), w1 = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
          for (int m = 0; m < MB; ++m) {
            int16_t pair;
            std::memcpy(&pair, x[m] + g * GROUP + 2 * s, sizeof(pair));
            const __m256i xv = _mm256_set1_epi16(pair);
            a[m][0] = _mm256_add_epi16(a[m][0], _mm256_maddubs_epi16(w0, xv));
            a[m][1] = _mm256_add_epi16(a[m][1], _mm256_maddubs_epi16(w1, xv));
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m256 hs = _mm256_set1_ps(xs[m][2 * g + half]);
          for (int j = 0; j < 2; ++j)
            for (int part = 0; part < 2; ++part) {
              const __m128i v16 = part ? _mm256_extracti128_si256(a[m][j], 1) : _mm256_castsi256_si128(a[m][j]);
              const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v16));
              float* dst = sum[m] + 16 * j + 8 * part;
              _mm256_store_ps(dst, half ? _mm256_fmadd_ps(v, hs, _mm256_load_ps(dst)) : _mm256_mul_ps(v, hs));
            }
        }
      }
      for (int i = 0; i < 4; ++i) {  // rows 32 h + 8 i .. + 7: register r = 4 h + i of dots_256
        const int r = 4 * h + i;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * r)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + VN + 8 * r)));
        for (int m = 0; m < MB; ++m) {
          const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m][g]), mn, _mm256_mul_ps(_mm256_load_ps(sum[m] + 8 * i), d));
          _mm256_storeu_ps(out[m] + 8 * r, _mm256_add_ps(v, _mm256_loadu_ps(out[m] + 8 * r)));
        }
      }
    }
  }
}

#pragma GCC pop_options

void dots_256_i8_rows(int rows, const int8_t* const* x, const float* const* xs, const float* const* xsum,
                      const uint8_t* p, int64_t KG, float (*out)[VN]) {
  switch (rows) {
    case 4: dots_256_i8<4>(x, xs, xsum, p, KG, out); break;
    case 3: dots_256_i8<3>(x, xs, xsum, p, KG, out); break;
    case 2: dots_256_i8<2>(x, xs, xsum, p, KG, out); break;
    default: dots_256_i8<1>(x, xs, xsum, p, KG, out); break;
  }
}

}  // namespace

bool set_gguf_avx512(bool on) {
  const bool was = g_avx512;
  g_avx512 = on;
  return was;
}

Packed gguf_layout(const torch::Tensor& wp, int64_t N, int64_t K) {
  const bool a8 = wp.scalar_type() == torch::kInt8;
  if ((wp.scalar_type() != torch::kUInt8 && !a8) || wp.dim() != 3 || K % GROUP != 0 || wp.size(0) != (N + VN - 1) / VN ||
      wp.size(1) != K / GROUP)
    return Packed::plain;
  if (wp.size(2) == Q4_RECORD) return a8 ? Packed::gguf_q4_a8 : Packed::gguf_q4;
  if (wp.size(2) == Q8_RECORD && !a8) return Packed::gguf_q8;
  return Packed::plain;
}

torch::Tensor pack_rows_gguf(torch::Tensor raw, int64_t ggml_type, int64_t K) {
  TORCH_CHECK(ggml_type == GGML_Q4_0 || ggml_type == GGML_Q4_1 || ggml_type == GGML_Q8_0,
              "pack_rows_gguf: tensor type ", ggml_type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K > 0 && K % GROUP == 0, "pack_rows_gguf: K must be a positive multiple of 32, got ", K);
  const int64_t block_bytes = ggml_type == GGML_Q4_0 ? 18 : ggml_type == GGML_Q4_1 ? 20 : 34;
  const int64_t raw_row = K / GROUP * block_bytes;
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(1) == raw_row,
              "pack_rows_gguf: raw must be uint8 [N, ", raw_row, "] (K / 32 blocks of ", block_bytes,
              " bytes a row), got ", raw.sizes());
  TORCH_CHECK(cpu_supports_f16c(), "pack_rows_gguf: the GGUF products need a CPU with F16C");
  raw = raw.contiguous();
  const int64_t N = raw.size(0), blocks = (N + VN - 1) / VN;
  const bool q8 = ggml_type == GGML_Q8_0;
  const int64_t row_bytes = q8 ? q8_row_bytes(K) : q4_row_bytes(K);
  auto out = torch::empty({blocks, K / GROUP, q8 ? Q8_RECORD : Q4_RECORD}, torch::TensorOptions().dtype(torch::kUInt8));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * VN, nb = std::min<int64_t>(VN, N - n0);
      if (q8) pack_block_q8(src + n0 * raw_row, raw_row, nb, K, dst + blk * row_bytes);
      else pack_block_q4(src + n0 * raw_row, raw_row, ggml_type == GGML_Q4_1, nb, K, dst + blk * row_bytes);
    }
  });
  return out;
}

void linear_gguf(const float* x, int64_t M, int64_t K, const uint8_t* wp, Packed layout, int64_t N, const float* bias,
                 float* y, int threads) {
  const bool q4 = layout == Packed::gguf_q4 || layout == Packed::gguf_q4_a8;
  const int64_t KG = K / GROUP, row_bytes = q4 ? q4_row_bytes(K) : q8_row_bytes(K);
  // the calling thread's buffers, kept between calls (a decode step makes 4 calls a layer)
  static thread_local std::vector<int16_t> xq_buf;
  static thread_local std::vector<float> xs_buf, xsum_buf;
  if (layout == Packed::gguf_q4_a8) {
    static thread_local std::vector<int8_t> x8_buf;
    quantize_groups_i8(x, M, K, x8_buf, xs_buf, xsum_buf);
    const int8_t* x8 = x8_buf.data();
    const float *s8 = xs_buf.data(), *t8 = xsum_buf.data();
    over_tiles_and_blocks<VN>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
      const uint8_t* p = wp + blk * row_bytes;
      alignas(64) float out[ROWS_512][VN];
      for (int64_t r0 = m0, n = 0; r0 < m1; r0 += n) {
        n = std::min<int64_t>(ROWS_I8, m1 - r0);
        const int8_t* xr[ROWS_512];
        const float* sr[ROWS_512];
        const float* tr[ROWS_512];
        for (int64_t i = 0; i < n; ++i)
          xr[i] = x8 + (r0 + i) * K, sr[i] = s8 + (r0 + i) * 2 * KG, tr[i] = t8 + (r0 + i) * KG;
        dots_256_i8_rows(static_cast<int>(n), xr, sr, tr, p, KG, out);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < nb; ++j) y[(r0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
      }
    });
    return;
  }
  quantize_groups(x, M, K, xq_buf, xs_buf, xsum_buf);
  // (pointers: inside the parallel region the names above would be each worker's own buffers)
  const int16_t* xq = xq_buf.data();
  const float *xs = xs_buf.data(), *xsum = xsum_buf.data();
  const bool wide = g_avx512 && cpu_has_vnni();
  over_tiles_and_blocks<VN>(M, N, threads, [&](int64_t m0, int64_t m1, int64_t blk, int64_t n0, int64_t nb) {
    const uint8_t* p = wp + blk * row_bytes;
    alignas(64) float out[ROWS_512][VN];
    for (int64_t r0 = m0, n = 0; r0 < m1; r0 += n) {
      n = wide ? rows_512(q4, m1 - r0) : 1;
      if (wide) {
        const int16_t* xr[ROWS_512];
        const float* sr[ROWS_512];
        const float* tr[ROWS_512];
        for (int64_t i = 0; i < n; ++i)
          xr[i] = xq + (r0 + i) * K, sr[i] = xs + (r0 + i) * KG, tr[i] = xsum + (r0 + i) * KG;
        if (q4) dots_512_rows<true>(static_cast<int>(n), xr, sr, tr, p, KG, out);
        else dots_512_rows<false>(static_cast<int>(n), xr, sr, tr, p, KG, out);
      } else if (q4) {
        dots_256<true>(xq + r0 * K, xs + r0 * KG, xsum + r0 * KG, p, KG, out[0]);
      } else {
        dots_256<false>(xq + r0 * K, xs + r0 * KG, xsum + r0 * KG, p, KG, out[0]);
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < nb; ++j) y[(r0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
    }
  });
}

}  // namespace cpu_kernels
