// One pre-norm decoder layer for a few tokens in one call (rows_layer: norms, q/k/v, rope, KV
// write, attention, o, SwiGLU MLP, every row in float32 through the products' and attention's
// row-exact orders), and RowsStack, a model's layers (and its embedding and final norm) run
// through rows_layer in one call per step.
#include "cpu_kernels.h"

#include <algorithm>
#include <vector>

namespace cpu_kernels {
namespace {

// The first min(n, 8) floats of p, zeros after (map8's tail).
inline __m256 load_tail(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, sizeof(float) * n);
  return _mm256_load_ps(tmp);
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

// One pre-norm decoder layer (attention + SwiGLU MLP) for a few tokens, every row in float32 and
// in a fixed order (the packed products, rows attention, per-row norms, rope and activation), so
// a token's outputs do not depend on the other tokens of the call; one call instead of ~20 torch
// ops per layer.
//   residual' = residual + x (residual empty: x);  h = rms_norm(residual') (in_norm empty: none)
//   q, k, v = h @ w_qkv.T + b_qkv (q/k per-head rms_norm if q_norm/k_norm given), rope (cos/sin
//   rows of each token's position [T, D]); k, v written at `slots` (< 0: not written) of the
//   paged caches; a = attention of each token over its ctx_lens[t] positions;
//   residual'' = residual' + a @ w_o.T + b_o; h2 = rms_norm(residual'') * post_norm;
//   g, u = h2 @ w_gate_up.T + b; out = (silu(g) * u) @ w_down.T + b_down.
// Returns (out, residual'') [T, E] float32. Weights packed (pack_rows), float32 or bfloat16 (one
// dtype); I the intermediate size; norm weights and biases float32.
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
  // one dtype; the byte layouts (int8 and uint8: GGUF blocks with int8 or int16 activations, a
  // drafter's int8 / int4) may mix, each checked as it is multiplied
  const auto dtype_class = [](torch::ScalarType t) { return t == torch::kInt8 ? torch::kUInt8 : t; };
  const auto wtype = dtype_class(w_qkv.scalar_type());
  for (const auto* w : {&w_qkv, &w_o, &w_gate_up, &w_down}) {
    TORCH_CHECK(dtype_class(w->scalar_type()) == wtype, "rows_layer: weights must be of one dtype");
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
  // and allocating them per call would cost a few percent of a step)
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

RowsStack::RowsStack(std::vector<std::vector<torch::Tensor>> weights, std::vector<torch::Tensor> k_caches,
                     std::vector<torch::Tensor> v_caches, int64_t H, int64_t Hkv, int64_t I, double eps,
                     double scale, std::vector<int64_t> aux)
    : w(std::move(weights)), kc(std::move(k_caches)), vc(std::move(v_caches)), H(H), Hkv(Hkv), I(I), eps(eps),
      scale(scale), aux(std::move(aux)) {
  TORCH_CHECK(w.size() == kc.size() && kc.size() == vc.size(), "RowsStack: one set of weights and caches per layer");
  for (const auto& lw : w) TORCH_CHECK(lw.size() == 12, "RowsStack: 12 tensors per layer (rows_layer's order)");
}

std::tuple<torch::Tensor, std::vector<torch::Tensor>> RowsStack::forward(torch::Tensor x, torch::Tensor cos,
                                                                         torch::Tensor sin, torch::Tensor slots,
                                                                         torch::Tensor tables, torch::Tensor lens,
                                                                         bool slot_rows, torch::Tensor tree) {
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

void RowsStack::set_ends(torch::Tensor embed_, torch::Tensor cos_, torch::Tensor sin_, torch::Tensor norm_, bool bf16) {
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

std::tuple<torch::Tensor, torch::Tensor> RowsStack::forward_tokens(torch::Tensor ids, torch::Tensor positions,
                                                                   torch::Tensor slots, torch::Tensor tables,
                                                                   torch::Tensor lens, bool slot_rows,
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

}  // namespace cpu_kernels
