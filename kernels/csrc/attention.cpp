// Paged attention. rows_attention: each of a few query tokens (a decode or verification step)
// over exactly its own context, by one of four kernels (cpu_kernels.h: how run_attention picks):
// attention_rows (AVX2, float32), attention_rows_512 (AVX-512, the same bits), attention_rows_dp
// (AVX512-BF16, bfloat16 caches) and attention_rows_amx (AMX tiles, bfloat16 caches); token trees
// by masks or slot tables. prefill_attention: causal attention of long query chunks (AVX512-BF16).
// Every kernel keeps cpu_kernels.h's row exactness: a token's result depends on its own query,
// its positions and the cache only.
#include "cpu_kernels.h"

#include <algorithm>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace cpu_kernels {
namespace {

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
  // would read 128 of every 512 bytes, a stride it does not follow). Heads are
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
      // starts each block's stream anew (no prefetch instruction changes a result).
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

}  // namespace

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
// to other requests. Not attention_rows_dp's bits (another order of the products' sums). Faster
// than attention_rows_dp for a verification's tokens, about as fast for a batch of decode tokens
// and slower for one token alone (the keys' transposes cost what one row's dot products do;
// `python -m bench.bench_kernels --attention` times the three).
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
  // together, whole cache rows in sequence, which the hardware prefetcher follows (one head per
  // item would read 1 / Hkv of each row, a stride it does not follow).
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
      // once (four accumulators in flight; the chunk's value rows are not prefetched meanwhile:
      // that slows the scores down)
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

// rows_attention's inputs (and prefill_attention's, one row per request) checked.
void check_paged(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
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

// Whether attention takes the 512-bit kernel where the CPU has it (the same bits either way;
// tests turn it off to compare the two).
static bool g_wide_attention = true;

bool set_wide_attention(bool on) {
  const bool before = g_wide_attention;
  g_wide_attention = on;
  return before;
}

// Whether bfloat16 caches may take attention_rows_dp where the CPU has AVX512-BF16: in rows_layer
// where the layer's weights are packed for dot products (SPECDECODE_CPU_BF16_DOT=0 at packing
// turns both off), in rows_attention where its caller asks; tests turn it off to compare the
// float32 kernels.
static bool g_dot_attention = true;

// Whether bfloat16 caches' rows attention runs on AMX tiles where it can (attention_rows_amx:
// AMX products on, dot-product attention on, head_dim 64, 128 or 256, at most 16 query heads per
// kv head, blocks of a multiple of 16 positions; default on).
static bool g_amx_attention = true;

bool set_amx_attention(bool on) {
  const bool before = g_amx_attention;
  g_amx_attention = on;
  return before;
}

bool set_dot_attention(bool on) {
  const bool before = g_dot_attention;
  g_dot_attention = on;
  return before;
}

// Token trees in a causal step (rows_attention, rows_layer): tree [T, 2] int64, per token (base,
// bits) or (-1, 0): a tree token at position base + i (its tree's root at base, nodes in index
// order) with causal length base + i + 1 sees positions before base and base + j iff bit j (its
// ancestors and itself; at most 64 nodes). Checked here; empty: no trees.
const int64_t* check_tree(const torch::Tensor& tree, const torch::Tensor& ctx_lens, int64_t T, const char* fn) {
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

void run_attention(const float* q, int64_t T, int64_t H, int64_t D, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& ctx_lens,
                   float scale, float* out, int threads, bool dot, const int64_t* tree) {
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

// Paged attention for a few query tokens, each over exactly its own context, in a fixed order:
// out[t, h] = sum_p softmax_p(scale * q[t, h] . k[p]) v[p] over positions p < ctx_lens[t] of the
// token's request (keys at block_tables[t, p / block_size], row p % block_size; kv head h / G).
// Scores: `dots` over D; max, exponentials and their sum in position order; the output
// accumulated in position order, then divided by the sum. Every (t, h) is one thread's work, so
// a token's output does not depend on the other tokens of the call.
// q [T, H, D] float32; k_cache, v_cache [num_blocks, block_size, Hkv, D] float32 or bfloat16;
// block_tables [T, max_blocks] int64; ctx_lens [T] int64. Returns [T, H, D] float32.
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

}  // namespace cpu_kernels
