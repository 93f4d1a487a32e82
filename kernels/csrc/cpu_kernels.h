// Row-invariant CPU kernels for the decode and verification steps (kernels/cpu_kernels.py builds
// and loads them): products over packed weights, paged attention, a whole pre-norm decoder layer,
// and drafters' chains and trees built from them.
//
//   products.cpp       weight packing and y = x @ w.T (+ b) in every packed layout
//   gguf_products.cpp  the same over a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored
//   attention.cpp      paged attention of a few query tokens (rows_attention) and of prefill chunks
//   decoder_layer.cpp  rows_layer (one decoder layer in one call) and RowsStack (all of a model's)
//   drafting.cpp       EAGLE-3, draft-model and feature drafters: chains, tree growth, sampling
//   bindings.cpp       the Python module
// This header holds what they share: the SIMD helpers every kernel inlines, the CPU queries, the
// shared types, and the functions one file calls in another.
//
// Row exactness, the invariant every kernel keeps: each output row (a query token) is computed by
// one thread in one fixed order that depends on the shapes of that row only, never on the number
// of rows, on the rows next to it, on the weight rows blocked with it or on the thread. A token's
// results are then the same bits whether its step computes it alone (a one-token decode step) or
// with others (the drafts of a verification, other requests). Each instruction path below has its
// own bits, and a process keeps one path per kind of call (the switches are set at load and never
// flipped while an engine runs), so a token's bits never depend on the step that computes it.
//
// Instruction paths. Everything is compiled with -mavx2 -mfma; the wider paths are compiled per
// function under `#pragma GCC target(...)` and taken at run time where the CPU has them:
//  - AVX2 + FMA, the floor (cpu_kernels.py builds nothing on a CPU without them): products over
//    weights packed 4 rows at a time, float32 or bfloat16 widened in registers (linear_packed);
//    attention_rows in float32; norms, rope, SiLU and the softmax's exp (exp8).
//  - AVX-512 F/BW/VL (cpu_has_avx512): attention_rows_512, attention_rows' bits in 16 lanes.
//  - AVX512-BF16 (cpu_has_dot_bf16): bfloat16 weights packed for `vdpbf16ps` (linear_dp: the
//    activations rounded to bfloat16, as torch's bfloat16 products take them), bfloat16 caches'
//    attention_rows_dp, and prefill_attention. Other bits than the float32 paths.
//  - AVX512-VNNI (cpu_has_vnni): int8 and int4 weights (linear_i8, linear_i4), for drafters only:
//    lossy, never the target's products; and a GGUF file's Q4_0/Q4_1/Q8_0 weights as stored
//    (linear_gguf, gguf_products.cpp: the target's), whose 256-bit kernel (AVX2 + F16C) gives the
//    same bits where the CPU lacks VNNI.
//  - AMX-BF16 tiles (cpu_has_amx_bf16: the CPU has them and Linux grants the tile state): the
//    dp-packed products whose K is a multiple of 32 (linear_amx) and bfloat16 caches' attention
//    (attention_rows_amx). Other bits than `vdpbf16ps`.
// How a path is picked: a product by the layout its weights were packed in (check_packed; the
// Python side packs bfloat16 weights for dot products where dot_bf16_available()), then AMX
// tiles over `vdpbf16ps` where amx_products(); attention by run_attention: for bfloat16 caches
// whose caller asks for dot products (rows_layer: where its weights are dp-packed) AMX tiles,
// else `vdpbf16ps`, where the head size and block size allow them; otherwise the 512-bit float32
// kernel where the CPU has AVX-512, else the 256-bit one. set_amx, set_amx_attention, set_dot_attention and set_wide_attention turn a path
// off (cpu_kernels.py sets the first two from SPECDECODE_CPU_* at load; tests compare paths).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace cpu_kernels {

// ---- SIMD helpers (AVX2 + FMA), inlined into every kernel that uses them ----------------------

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
// squares; the matmul has its own, products.cpp): two 8-lane accumulators, a over k % 16 in
// [0, 8) and b over [8, 16), in steps of 16; a remaining 8-wide step into a; then a + b, a fixed
// horizontal sum, then the scalar tail in k order. `NB` rows of w (float32, or bfloat16 widened in registers)
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

inline float dot_f32(const float* x, const float* w, int64_t K) {
  float s;
  dots<1>(x, &w, K, &s);
  return s;
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

// ---- what the CPU runs (queried once per process) --------------------------------------------

inline bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

inline bool cpu_has_dot_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

inline bool cpu_supports_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c");
  return yes;
}

inline bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// AMX-BF16 tiles with the state granted (products.cpp's AMX section describes the tile path).
inline bool cpu_has_amx_bf16() {
  static const bool yes = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) return false;
    // Linux hands the 8 KB tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return yes;
}

// ---- the products' blocking, shared by every layout ------------------------------------------

// Outputs per block of the 512-bit layouts (dp, int8, int4, GGUF blocks) and their registers of 16.
constexpr int64_t VN = 64, VZ = VN / 16;

// Rows of x per tile: the weights stream once per tile while the tile's rows stay in L2 (for
// K = 1408, 48 float32 rows are 270 KB); without tiles a long prefill re-read all of x from
// L3 for every block of weight rows. Decode and verification steps (<= 16 rows) are one tile.
constexpr int64_t M_TILE = 48;

// The tiles of M_TILE rows of x, and in each the blocks of BW weight rows split among threads:
// f(m0, m1, blk, n0, nb) per block (rows n0 .. n0 + nb of y).
template <int64_t BW, typename F>
void over_tiles_and_blocks(int64_t M, int64_t N, int threads, F&& f) {
  const int64_t blocks = (N + BW - 1) / BW;
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int64_t m1 = std::min(M, m0 + M_TILE);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t blk = 0; blk < blocks; ++blk) f(m0, m1, blk, blk * BW, std::min<int64_t>(BW, N - blk * BW));
  }
}

// ---- shared types ----------------------------------------------------------------------------

// An AMX tile configuration (ldtilecfg's 64-byte operand): per tile register, its rows and bytes
// per row.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Which packed layout a weight tensor is in (pack_rows, pack_rows_int8, pack_rows_int4, pack_rows_gguf).
enum class Packed { plain, dot_bf16, int8, int4, gguf_q4, gguf_q8, gguf_q4_a8 };

// ---- products.cpp ----------------------------------------------------------------------------

torch::Tensor pack_rows(torch::Tensor w, bool dot_bf16);
torch::Tensor pack_rows_int8(torch::Tensor w);
torch::Tensor pack_rows_int4(torch::Tensor w);
// wp's layout, checked against a product of N x K (`what` names the caller in errors).
Packed check_packed(const torch::Tensor& wp, int64_t N, int64_t K, const char* what);
// y = x @ w.T (+ b) over M rows, wp in `layout`.
void packed_product(const float* x, int64_t M, int64_t K, const torch::Tensor& wp, Packed layout, int64_t N,
                    const float* bias, float* y, int threads);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, int64_t n, torch::Tensor b);
torch::Tensor packed_linear_rows(torch::Tensor x, std::vector<int64_t> rows, torch::Tensor wp, int64_t n);
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor b);
bool amx_products();  // the dp-packed products run on AMX tiles now (cpu_has_amx_bf16 and set_amx)
bool set_amx(bool on);

// ---- gguf_products.cpp -------------------------------------------------------------------------

// GGML tensor types (the GGUF file's tensor_type) that pack_rows_gguf takes.
constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8;
// raw [N, K / 32 * block bytes] uint8 blocks of a GGUF tensor of `ggml_type` -> the layout of the
// GGUF products: Packed::gguf_q4 (Q4_0, Q4_1) or Packed::gguf_q8 (Q8_0); Packed::gguf_q4_a8: Q4
// records viewed as int8 (gguf_int8_activations), multiplied with int8 activations.
torch::Tensor pack_rows_gguf(torch::Tensor raw, int64_t ggml_type, int64_t K);
// The layout of a uint8 tensor of N x K weights in one of the GGUF layouts, or Packed::plain if
// its shape fits neither.
Packed gguf_layout(const torch::Tensor& wp, int64_t N, int64_t K);
void linear_gguf(const float* x, int64_t M, int64_t K, const uint8_t* wp, Packed layout, int64_t N, const float* bias,
                 float* y, int threads);
bool set_gguf_avx512(bool on);  // the 512-bit GGUF products where the CPU has AVX512-VNNI (default on)

// ---- attention.cpp ---------------------------------------------------------------------------

// The caches, block tables and context lengths of T query tokens of H heads of D checked.
void check_paged(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                 const torch::Tensor& ctx_lens, int64_t T, int64_t H, int64_t D, const char* fn);
// A step's token trees checked (rows_attention's `tree`); null where there are none.
const int64_t* check_tree(const torch::Tensor& tree, const torch::Tensor& ctx_lens, int64_t T, const char* fn);
// Attention of T query tokens q [T, H, D] -> out, by the path the header comment describes.
void run_attention(const float* q, int64_t T, int64_t H, int64_t D, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& ctx_lens,
                   float scale, float* out, int threads, bool dot, const int64_t* tree = nullptr);
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor ctx_lens, double scale, bool dot, torch::Tensor tree);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                                double scale);
bool set_wide_attention(bool on);
bool set_dot_attention(bool on);
bool set_amx_attention(bool on);
torch::Tensor exp_f32(torch::Tensor x);

// ---- decoder_layer.cpp -----------------------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> rows_layer(
    torch::Tensor x, torch::Tensor residual, torch::Tensor cos, torch::Tensor sin, torch::Tensor in_norm,
    torch::Tensor post_norm, torch::Tensor w_qkv, torch::Tensor b_qkv, torch::Tensor w_o, torch::Tensor b_o,
    torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor w_gate_up, torch::Tensor b_gate_up,
    torch::Tensor w_down, torch::Tensor b_down, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
    torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
    torch::Tensor attn_in, torch::Tensor tree);

// A stack of decoder layers run through rows_layer in one call (the target's few-token steps:
// decode, verification): the layers' tensors and KV caches are handed over once, at load,
// instead of ~27 arguments converted per layer per step.
struct RowsStack {
  std::vector<std::vector<torch::Tensor>> w;  // per layer: rows_layer's 12 tensors, in its order
  std::vector<torch::Tensor> kc, vc;
  int64_t H, Hkv, I;
  double eps, scale;
  std::vector<int64_t> aux;

  RowsStack(std::vector<std::vector<torch::Tensor>> weights, std::vector<torch::Tensor> k_caches,
            std::vector<torch::Tensor> v_caches, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
            std::vector<int64_t> aux);

  // Every layer as rows_layer runs it (the same bits): returns the last layer's residual stream
  // (residual + out, before the final norm) and, for each boundary b in aux (in layer order), the
  // residual stream entering layer b (b == number of layers: the last one). slot_rows: the block
  // tables are slot tables, the caches viewed with one slot per block (see rows_attention's
  // callers). tree: token trees as rows_attention takes them (empty: none).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                                torch::Tensor slots, torch::Tensor tables,
                                                                torch::Tensor lens, bool slot_rows, torch::Tensor tree);

  // The model's ends, for forward_tokens: the embedding [V, E] (float32 or bfloat16), the rope
  // tables [P, D] float32 (rows by position), the final norm [E] float32; out_bf16: the model's
  // dtype is bfloat16 (its hidden rows and auxiliary features are rounded to it).
  torch::Tensor embed, rope_cos, rope_sin, final_norm;
  bool out_bf16 = false;

  void set_ends(torch::Tensor embed_, torch::Tensor cos_, torch::Tensor sin_, torch::Tensor norm_, bool bf16);

  // A whole few-token step from token ids: embedding rows (widened to float32), rope rows of the
  // positions, every layer (forward), the final norm (rms_norm_row) and the model's dtype, in one
  // call. Returns (hidden [T, E], the aux streams concatenated [T, len(aux) * E] or empty), both
  // in the model's dtype: what the torch ops around forward made, in one call instead of ~10 ops
  // that each meet caches a step's weights went through.
  std::tuple<torch::Tensor, torch::Tensor> forward_tokens(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
                                                          torch::Tensor tables, torch::Tensor lens, bool slot_rows,
                                                          torch::Tensor tree);
};

// ---- drafting.cpp ----------------------------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> draft_chain(
    torch::Tensor feats, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner,
    torch::Tensor block_tables, torch::Tensor num_drafts, torch::Tensor embed, torch::Tensor in_ln,
    torch::Tensor hidden_norm, torch::Tensor final_norm, bool norm_before_residual, torch::Tensor post_norm,
    torch::Tensor w_qkv, torch::Tensor w_o, torch::Tensor w_gate_up, torch::Tensor w_down, torch::Tensor lm_head,
    int64_t n_draft, torch::Tensor token_ids, torch::Tensor rope_cos, torch::Tensor rope_sin,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t H, int64_t Hkv, int64_t I, double eps, double scale,
    bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> draft_tree(
    torch::Tensor feats, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner,
    torch::Tensor block_tables, torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature,
    double min_logprob, torch::Tensor embed, torch::Tensor in_ln, torch::Tensor hidden_norm, torch::Tensor final_norm,
    bool norm_before_residual, torch::Tensor post_norm, torch::Tensor w_qkv, torch::Tensor w_o,
    torch::Tensor w_gate_up, torch::Tensor w_down, torch::Tensor lm_head, int64_t n_draft, torch::Tensor token_ids,
    torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor k_cache, torch::Tensor v_cache, int64_t H,
    int64_t Hkv, int64_t I, double eps, double scale, bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> stack_tree(
    RowsStack& stack, torch::Tensor tokens, torch::Tensor positions, torch::Tensor owner, torch::Tensor block_tables,
    torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature, double min_logprob,
    torch::Tensor lm_head, int64_t n_draft, torch::Tensor token_ids, torch::Tensor sampling, torch::Tensor uniforms);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> feature_tree(
    RowsStack& stack, torch::Tensor root_feats, torch::Tensor tokens, torch::Tensor positions,
    torch::Tensor block_tables, torch::Tensor depths, torch::Tensor widths, torch::Tensor num_nodes, double temperature,
    double min_logprob, torch::Tensor embed, torch::Tensor token_norm, torch::Tensor hidden_norm, bool hidden_first,
    torch::Tensor proj, torch::Tensor proj_bias, torch::Tensor out_norm, bool norm_after, torch::Tensor lm_head,
    int64_t n_draft, torch::Tensor token_ids, torch::Tensor rope_cos, torch::Tensor rope_sin, int64_t rope_offset,
    bool round_bf16, torch::Tensor sampling, torch::Tensor uniforms);
void move_slots(std::vector<torch::Tensor> caches, torch::Tensor src, torch::Tensor dst);

}  // namespace cpu_kernels
