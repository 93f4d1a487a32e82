// Drafting in one call per round, over the decoder layer and products: an EAGLE-3 head's chains
// (draft_chain) and dynamic trees (draft_tree), a draft model's trees (stack_tree) and a
// one-module feature drafter's (feature_tree), all grown by one tree growth over a drafter
// interface (grow_trees_in_one_call); greedy or sampled drafts (filtered_probs, sample_row: the
// engine's sampler's filtering and inverse CDF); and move_slots, the KV moves that commit an
// accepted tree path.
#include "cpu_kernels.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace cpu_kernels {

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

// Chain drafting of an EAGLE-3 head in one call (engine/spec_decode/proposers/eagle3.py describes
// the head): the midlayer's catch-up forward over each request's buffered elements, then, for
// each request, num_drafts[b] drafts, every forward after the first on the element (own output
// feature, token just drafted) at the next position: one call per drafting round instead of a
// Python loop of forwards and samples. Each forward is `rows_layer` on
//   x_in = [rms_norm(embed[token]) * in_ln, rms_norm(g) * hidden_norm]   (q/k/v's input, 2H)
//   x = rms_norm(g) * hidden_norm if norm_before_residual else g          (the residual stream)
// and a draft is argmax(lm_head(rms_norm(out) * final_norm)) over the draft vocabulary (a request
// whose `sampling` row [R, 3] sets a temperature > 0: drawn by sample_row with uniforms[b, step]),
// mapped to a target id by token_ids (empty: the identity). round_bf16 rounds the output features and
// the final norm's output to bfloat16, where a bfloat16 head's torch path holds them in its dtype.
//   feats [N0, H] float32, tokens / positions / owner [N0] int64 (each request's rows together,
//   in position order); block_tables [R, W] int64 (the request's blocks: KV slots and context);
//   num_drafts [R] int64 >= 1; embed [V, H] float32 or bfloat16; norms float32 [H]; rope_cos /
//   rope_sin [P, D] float32 (rows by position); lm_head packed (pack_rows) of n_draft rows.
// Returns (drafts [R, max(num_drafts)] int64, -1 past a request's num_drafts; with `sampling`,
// each draft's distribution [R, max(num_drafts), n_draft] float32, zeros for greedy requests); the
// head's KV of every element is written at its position's slot.
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

}  // namespace cpu_kernels
