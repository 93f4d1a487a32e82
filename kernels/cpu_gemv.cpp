// Row-invariant small-batch matmul for CPUs with AVX2 + FMA: y = x @ w.T (+ b).
//
// x: [M, K] float32 (a few rows: decode and verification steps), w: [N, K] float32 or bfloat16,
// b: [N] float32 or empty; y: [M, N] float32.
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
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// The fixed order of every dot product over K: two 8-lane accumulators, a over k % 16 in [0, 8)
// and b over [8, 16), in steps of 16; a remaining 8-wide step into a; then a + b, a fixed
// horizontal sum, then the scalar tail in k order. `NB` weight rows (float32 or bfloat16) share
// each load of x (more independent FMA chains, fewer loads); each (x, w row) pair keeps exactly
// this order.
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

inline float dot_f32(const float* x, const float* w, int64_t K) {
  float s;
  dots<1>(x, &w, K, &s);
  return s;
}

// Widen K bfloat16 values to float32 (exact).
inline void widen_bf16(const uint16_t* src, float* dst, int64_t K) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load_bf16(src + k));
  for (; k < K; ++k) dst[k] = bf16_to_f32(src[k]);
}

}  // namespace

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rows_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rows_linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "rows_linear: w must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == w.size(1), "rows_linear: x and w disagree on K");
  TORCH_CHECK(!b.defined() || b.numel() == 0 || (b.numel() == w.size(0) && b.scalar_type() == torch::kFloat32),
              "rows_linear: b must be float32 [N] or empty");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool has_bias = b.defined() && b.numel() > 0;
  const float* bp = has_bias ? b.contiguous().data_ptr<float>() : nullptr;
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  const float* wf = bf16 ? nullptr : w.data_ptr<float>();
  const uint16_t* wh = bf16 ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) : nullptr;
  const int threads = at::get_num_threads();
  constexpr int NB = 4;  // weight rows per block: each load of x serves NB of them
  const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * NB, nb = std::min<int64_t>(NB, N - n0);
    float out[NB];
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xp + m * K;
      if (nb == NB) {
        if (bf16) {
          const uint16_t* w[NB] = {wh + n0 * K, wh + (n0 + 1) * K, wh + (n0 + 2) * K, wh + (n0 + 3) * K};
          dots<NB>(xm, w, K, out);
        } else {
          const float* w[NB] = {wf + n0 * K, wf + (n0 + 1) * K, wf + (n0 + 2) * K, wf + (n0 + 3) * K};
          dots<NB>(xm, w, K, out);
        }
      } else {
        for (int64_t j = 0; j < nb; ++j) {
          if (bf16) {
            const uint16_t* w = wh + (n0 + j) * K;
            dots<1>(xm, &w, K, out + j);
          } else {
            const float* w = wf + (n0 + j) * K;
            dots<1>(xm, &w, K, out + j);
          }
        }
      }
      for (int64_t j = 0; j < nb; ++j) yp[m * N + n0 + j] = out[j] + (has_bias ? bp[n0 + j] : 0.0f);
    }
  }
  return y;
}

// Paged attention for a few query tokens, each over exactly its own context, in a fixed order:
// out[t, h] = sum_p softmax_p(scale * q[t, h] . k[p]) v[p] over positions p < ctx_lens[t] of the
// token's request (keys at block_tables[t, p / block_size], row p % block_size; kv head h / G).
// Scores: dot_f32 over D; max, exponentials and their sum in position order; the output
// accumulated in position order, then divided by the sum. Every (t, h) is one thread's work, so
// a token's output does not depend on the other tokens of the call.
// q [T, H, D] float32; k_cache, v_cache [num_blocks, block_size, Hkv, D] float32 or bfloat16;
// block_tables [T, max_blocks] int64; ctx_lens [T] int64. Returns [T, H, D] float32.
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "rows_attention: q must be float32 [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "rows_attention: caches [blocks, bs, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              "rows_attention: caches must both be float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rows_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && ctx_lens.scalar_type() == torch::kInt64,
              "rows_attention: block_tables and ctx_lens must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  ctx_lens = ctx_lens.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "rows_attention: head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == T && ctx_lens.size(0) == T, "rows_attention: one table and length per token");
  const int64_t G = H / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lens[t] >= 1 && lens[t] <= max_blocks * bs, "rows_attention: ctx_lens out of range");
  }
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  const int64_t row_stride = Hkv * D;  // elements between consecutive positions of one block
  const float fscale = static_cast<float>(scale);
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, kbuf(D), vbuf(D), acc(D);
#pragma omp for schedule(static)
    for (int64_t th = 0; th < T * H; ++th) {
      const int64_t t = th / H, h = th % H, kvh = h / G, L = lens[t];
      const float* qv = qp + (t * H + h) * D;
      scores.resize(L);
      auto row = [&](const void* cache, int64_t p, float* buf) -> const float* {
        const int64_t block = tables[t * max_blocks + p / bs];
        const int64_t off = (block * bs + p % bs) * row_stride + kvh * D;
        if (bf16) {
          widen_bf16(static_cast<const uint16_t*>(cache) + off, buf, D);
          return buf;
        }
        return static_cast<const float*>(cache) + off;
      };
      float mx = -INFINITY;
      for (int64_t p = 0; p < L; ++p) {
        const float s = dot_f32(qv, row(kp, p, kbuf.data()), D) * fscale;
        scores[p] = s;
        mx = s > mx ? s : mx;
      }
      float sum = 0.0f;
      for (int64_t p = 0; p < L; ++p) {
        scores[p] = std::exp(scores[p] - mx);
        sum += scores[p];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < L; ++p) {
        const float* vv = row(vp, p, vbuf.data());
        const __m256 e = _mm256_set1_ps(scores[p]);
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
          _mm256_storeu_ps(acc.data() + d, _mm256_fmadd_ps(e, _mm256_loadu_ps(vv + d), _mm256_loadu_ps(acc.data() + d)));
        }
        for (; d < D; ++d) acc[d] += scores[p] * vv[d];
      }
      const float inv = 1.0f / sum;
      float* o = op + (t * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "row-invariant small-batch x @ w.T + b (AVX2/FMA)");
  m.def("rows_attention", &rows_attention, "row-invariant paged attention of a few query tokens (AVX2/FMA)");
}
