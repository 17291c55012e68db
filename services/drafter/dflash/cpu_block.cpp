// The dflash drafter's inference on the CPU (see cpu_block.py); compiled after common/kernels/cpu_shared.cpp
// (vf, loadv, exp_neg, linear_into), cpu_bf16.cpp and cpu_walk.cpp (walk_rows) and cpu_bf16.cpp (linear_bf16_into, linear_i8_into).
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

// Scratch space kept from call to call, one set per thread: the block's vectors alone are tens of KB, which a
// std::vector would zero-fill on every call, and each element is written before it is read.
template <int Id>
static float* scratch(size_t n) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// A projection: packed [O / 64, I, 64] (fp32), [O / 64, I / 2, 64, 2] (bf16) or [O / 64, I / 4 + 1, 64, 4]
// (int8) through a kernel, or (an output count that is not whole panels) the plain weight [O, I] row by row.
// I % 16 == 0.
static void project(const float* x, int64_t N, int64_t I, const torch::Tensor& w, float* y) {
  if (w.dim() == 3) { linear_into(x, N, I, w, y); return; }
  if (w.dim() == 4 && w.scalar_type() == torch::kChar) { linear_i8_into(x, N, I, w, y); return; }
  if (w.dim() == 4) { linear_bf16_into(x, N, I, w, y); return; }
  const int64_t O = w.size(0);
  const float* wp = w.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) y[n * O + o] = dot16(x + n * I, wp + o * I, I);
}

struct Conv {  // a DynamicConv: base [2, K, H], dyn [N, 2 * K * G] from the sublayer input
  const float* base; const float* dyn; int64_t K, G, group;
  // y[r, t] = sum_{j < K, j <= t} c[r, t, s, j] * x[r, t - j], c = base + dyn repeated over each group.
  void apply(const float* x, float* y, int64_t R, int64_t B, int64_t H, int s) const {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < B; ++t) {
        const int64_t n = r * B + t;
        const float* d = dyn + n * 2 * K * G + s * K * G;
        float* yn = y + n * H;
        for (int64_t j = 0; j < K && j <= t; ++j) {  // tap by tap, a group's coefficient at a time (vectorised)
          const float* b = base + (s * K + j) * H;
          const float* xj = x + (n - j) * H;
          for (int64_t g = 0; g < G; ++g) {
            const float c = d[j * G + g];
            for (int64_t h = g * group; h < (g + 1) * group; ++h)
              yn[h] = j ? yn[h] + (b[h] + c) * xj[h] : (b[h] + c) * xj[h];
          }
        }
      }
  }
};

// Attention of each block row to its request's first lens[r] cached positions (layer l, read in place)
// and to the whole block; qkv [R * B, (heads + 2 kv_heads) hd] normed and rotated -> att [R * B, heads hd].
// Every query of a request sees the same lens[r] + B keys. Tasks: a KV head's heads-per-kv x B queries in chunks of
// VW (one vector's lanes), transposed (qt[d] holds element d of each query, scaled), so that one key gives the
// chunk's VW scores as hd products of a vector by the key's element: the key rows read as they lie, and no
// horizontal sums (`attend_head`, which the target uses, spends most of its time in those at these sizes). The
// softmax runs across the chunk's queries at once, key by key; the values are weighted 4 queries at a time.
// A proposal is a little faster this way than with attend_head, at concurrency 1 and at 16 requests.
template <int BLK>
static void attend_chunk(const float* const* qs, int64_t count, const float* kctx, const float* vctx,
                         const float* kblock, const float* vblock, int64_t C, int64_t n, int64_t QKV, float scale,
                         float* const* outs, float* st) {
  constexpr int64_t hd = BLK * VW;
  alignas(64) float qt[hd * VW];
  for (int64_t d = 0; d < hd; ++d)
    for (int64_t i = 0; i < VW; ++i) qt[d * VW + i] = i < count ? qs[i][d] * scale : 0.f;
  auto key = [&](int64_t j) { return j < C ? kctx + j * hd : kblock + (j - C) * QKV; };
  auto value = [&](int64_t j) { return j < C ? vctx + j * hd : vblock + (j - C) * QKV; };
  vf m = vf{} - INFINITY;
  for (int64_t j = 0; j < n; ++j) {  // st[j]: key j's scores, a lane per query
    const float* k = key(j);
    vf acc = vf{};
    for (int64_t d = 0; d < hd; ++d) acc += loadv<vf>(qt + d * VW) * k[d];
    __builtin_memcpy(st + j * VW, &acc, sizeof acc);
    m = acc > m ? acc : m;
  }
  vf total = vf{};
  for (int64_t j = 0; j < n; ++j) {
    const vf e = exp_neg<vf, vif>(loadv<vf>(st + j * VW) - m);
    __builtin_memcpy(st + j * VW, &e, sizeof e);
    total += e;
  }
  for (int64_t i0 = 0; i0 < count; i0 += 4) {  // weighted values
    vf acc[4][BLK];
    for (int q = 0; q < 4; ++q) for (int c = 0; c < BLK; ++c) acc[q][c] = vf{};
    for (int64_t j = 0; j < n; ++j) {
      const float* v = value(j);
      const float* w = st + j * VW + i0;
      for (int c = 0; c < BLK; ++c) {
        const vf vv = loadv<vf>(v + VW * c);
        for (int q = 0; q < 4; ++q) acc[q][c] += vv * w[q];
      }
    }
    for (int64_t q = 0; q < 4 && i0 + q < count; ++q)
      for (int c = 0; c < BLK; ++c) {
        const vf y = acc[q][c] / total[i0 + q];
        __builtin_memcpy(outs[i0 + q] + VW * c, &y, sizeof y);
      }
  }
}

static void attend(const float* qkv, float* att, int64_t R, int64_t B, int64_t l, const torch::Tensor& kc,
                   const torch::Tensor& vc, const int64_t* slots, const int64_t* lens, int64_t heads, int64_t kv_heads,
                   int64_t hd) {
  const int64_t S = kc.size(1), M = kc.size(3), QKV = (heads + 2 * kv_heads) * hd, per_kv = heads / kv_heads;
  const int64_t nq = per_kv * B, chunks = (nq + VW - 1) / VW;
  const float scale = 1.0f / std::sqrt(float(hd));
  at::parallel_for(0, R * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    float* st = scratch<13>((M + B) * VW);  // scores: each thread its own
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (kv_heads * chunks), g = task / chunks % kv_heads, first = task % chunks * VW;
      const int64_t count = std::min<int64_t>(VW, nq - first);
      const int64_t base = (((l * S + slots[r]) * kv_heads + g) * M) * hd;
      // Query first + i: head g * per_kv + (first + i) / B, block row (first + i) % B.
      const float* qs[VW];
      float* outs[VW];
      for (int64_t i = 0; i < VW; ++i) {
        const int64_t q = first + std::min(i, count - 1), row = r * B + q % B, head = g * per_kv + q / B;
        qs[i] = qkv + row * QKV + head * hd;
        outs[i] = att + row * heads * hd + head * hd;
      }
      const float* kblock = qkv + r * B * QKV + (heads + g) * hd;
      const float* vblock = qkv + r * B * QKV + (heads + kv_heads + g) * hd;
      const float *kctx = kc.data_ptr<float>() + base, *vctx = vc.data_ptr<float>() + base;
      const int64_t C = lens[r], n = C + B;
      switch (hd / VW) {
        case 1: attend_chunk<1>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        case 2: attend_chunk<2>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        case 4: attend_chunk<4>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        case 8: attend_chunk<8>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        case 16: attend_chunk<16>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        case 32: attend_chunk<32>(qs, count, kctx, vctx, kblock, vblock, C, n, QKV, scale, outs, st); break;
        default: TORCH_CHECK(false, "drafter attention: head size ", hd, " unsupported");
      }
    }
  });
}

// Per layer, 12 tensors: input norm, qkv packed, q norm, k norm, o packed, post norm, gate/up packed,
// down packed, attention conv base, its projection packed, MLP conv base, its projection packed (the
// conv ones undefined without convs). Then the final norm.
// x [R, B, H] in place: block embeddings in, normed hidden states out.
static void block_rows(float* x, int64_t R, int64_t B, int64_t H, const torch::Tensor& kc, const torch::Tensor& vc,
                       const int64_t* slots, const int64_t* lens, const torch::Tensor& cos_t, const torch::Tensor& sin_t,
                       const std::vector<torch::Tensor>& w, int64_t heads, int64_t kv_heads, int64_t hd,
                       int64_t conv_taps, int64_t group, double eps_d) {
  const int64_t N = R * B;
  const int64_t L = (int64_t(w.size()) - 1) / 12;
  const int64_t QKV = (heads + 2 * kv_heads) * hd, I = (w[6].dim() >= 3 ? w[6].size(0) * 64 : w[6].size(0)) / 2;
  const float eps = float(eps_d);
  const float* cos = cos_t.data_ptr<float>();
  const float* sin = sin_t.data_ptr<float>();
  float *u = scratch<0>(N * H), *u0 = scratch<1>(N * H), *a = scratch<2>(N * H), *qkv = scratch<3>(N * QKV);
  float *att = scratch<4>(N * heads * hd), *gu = scratch<5>(N * 2 * I), *hmid = scratch<6>(N * I);
  const int64_t G = conv_taps ? H / group : 0;
  float* dyn = scratch<7>(conv_taps ? N * 2 * conv_taps * G : 0);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* lw = &w[12 * l];
    Conv conv{nullptr, dyn, conv_taps, G, group};
    // A sublayer's input: normed x, then (with convs) the coefficients from it and the first convolution.
    auto sublayer_in = [&](const torch::Tensor& norm, const torch::Tensor& base, const torch::Tensor& proj) {
      rms_rows(x, norm.data_ptr<float>(), u, N, H, eps);
      if (!conv_taps) return static_cast<const float*>(u);
      project(u, N, H, proj, dyn);
      conv.base = base.data_ptr<float>();
      conv.apply(u, u0, R, B, H, 0);
      return static_cast<const float*>(u0);
    };
    // Its output (with convs, the second convolution) added to the residual stream.
    auto add_sublayer_out = [&](const float* out) {
      if (conv_taps) { conv.apply(out, u0, R, B, H, 1); out = u0; }
      for (int64_t i = 0; i < N * H; ++i) x[i] += out[i];
    };
    project(sublayer_in(lw[0], lw[8], lw[9]), N, H, lw[1], qkv);  // attention
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < B; ++t) {
        float* row = qkv + (r * B + t) * QKV;
        const int64_t pos = lens[r] + t;
        for (int64_t h = 0; h < heads; ++h)
          norm_rope(row + h * hd, lw[2].data_ptr<float>(), cos + pos * hd, sin + pos * hd, hd, eps);
        for (int64_t h = 0; h < kv_heads; ++h)
          norm_rope(row + (heads + h) * hd, lw[3].data_ptr<float>(), cos + pos * hd, sin + pos * hd, hd, eps);
      }
    attend(qkv, att, R, B, l, kc, vc, slots, lens, heads, kv_heads, hd);
    project(att, N, heads * hd, lw[4], a);
    add_sublayer_out(a);
    project(sublayer_in(lw[5], lw[10], lw[11]), N, H, lw[6], gu);  // MLP
    for (int64_t n = 0; n < N; ++n)  // silu(gate) * up, VW at a time: sigmoid from e^-|g| (exp_neg takes x <= 0)
      for (int64_t i = 0; i < I; i += VW) {
        const vf g = loadv<vf>(gu + n * 2 * I + i), e = exp_neg<vf, vif>(g < 0 ? g : -g);
        const vf out = g * (g < 0 ? e : 1.0f) / (1.0f + e) * loadv<vf>(gu + n * 2 * I + I + i);
        __builtin_memcpy(hmid + n * I + i, &out, sizeof out);
      }
    project(hmid, N, I, lw[7], a);
    add_sublayer_out(a);
  }
  rms_rows(x, w.back().data_ptr<float>(), x, N, H, eps);
}

torch::Tensor block(torch::Tensor x_in, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots, torch::Tensor lens,
                    torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> w, int64_t heads,
                    int64_t kv_heads, int64_t hd, int64_t conv_taps, int64_t group, double eps) {
  auto out = x_in.clone();
  block_rows(out.data_ptr<float>(), x_in.size(0), x_in.size(1), x_in.size(2), kc, vc, slots.data_ptr<int64_t>(),
             lens.data_ptr<int64_t>(), cos, sin, w, heads, kv_heads, hd, conv_taps, group, eps);
  return out;
}

// Context K/V of new positions: taps [N, T] -> fc -> norm -> per layer K/V projection, K norm, RoPE,
// written to the cache at (slot, position) of each row.
static void context_rows(const float* taps, int64_t N, int64_t T, const int64_t* slots, const int64_t* pos,
                         const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& cos_t,
                         const torch::Tensor& sin_t, const torch::Tensor& fc, const torch::Tensor& norm_w,
                         const std::vector<torch::Tensor>& kv_w, int64_t kv_heads, int64_t hd, double eps_d) {
  const int64_t H = norm_w.size(0), L = int64_t(kv_w.size()) / 2;
  const int64_t S = kc.size(1), M = kc.size(3);
  const float eps = float(eps_d);
  float *h = scratch<8>(N * H), *kv = scratch<9>(N * 2 * kv_heads * hd);
  project(taps, N, T, fc, h);
  rms_rows(h, norm_w.data_ptr<float>(), h, N, H, eps);
  for (int64_t l = 0; l < L; ++l) {
    project(h, N, H, kv_w[2 * l], kv);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < kv_heads; ++g) {
        float* k = kv + n * 2 * kv_heads * hd + g * hd;
        const float* v = k + kv_heads * hd;
        norm_rope(k, kv_w[2 * l + 1].data_ptr<float>(), cos_t.data_ptr<float>() + pos[n] * hd,
                  sin_t.data_ptr<float>() + pos[n] * hd, hd, eps);
        const int64_t at = (((l * S + slots[n]) * kv_heads + g) * M + pos[n]) * hd;
        std::copy(k, k + hd, kc.data_ptr<float>() + at);
        std::copy(v, v + hd, vc.data_ptr<float>() + at);
      }
  }
}

void context(torch::Tensor taps, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots, torch::Tensor pos,
             torch::Tensor cos, torch::Tensor sin, torch::Tensor fc, torch::Tensor norm_w,
             std::vector<torch::Tensor> kv_w, int64_t kv_heads, int64_t hd, double eps) {
  context_rows(taps.data_ptr<float>(), taps.size(0), taps.size(1), slots.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
               kc, vc, cos, sin, fc, norm_w, kv_w, kv_heads, hd, eps);
}

// A whole proposal in one call, greedy or sampling. The arguments that stay from call to call (the caches, tables and weights,
// read in place) are bound once in a `Proposer` (cpu_block.py binds one per set of prepared weights): a call then
// converts a handful of small arguments instead of 33, and returns the tokens as lists, not as a tensor. `watched`
// are the weights the packed ones were copied from, with their versions then: after one of them changed in place
// (load_state_dict), a call proposes nothing and returns None, and the caller packs and binds them again.
// * context: features[i] ([end - start, n_taps * H], positions [start, end)) become context K/V of slot ctx_slots[i];
// * the block of request r, [anchors[r], MASK...] embedded from `embedding`, through `block_rows` at slot
//   slots[r] after its lens[r] context positions;
// * the LM head over draft slots 1..S (then the optional scale and soft cap of the draft logits); its rows are
//   the draft vocabulary `ids` where that is not empty;
// * the selector's walk (cpu_walk.cpp) -> tokens, S per request.
struct Proposer {
  torch::Tensor kc, vc, cos, sin, fc, hidden_norm;
  std::vector<torch::Tensor> kv_w;
  torch::Tensor embedding;
  int64_t mask_id;
  std::vector<torch::Tensor> w;
  int64_t heads, kv_heads, hd, conv_taps, group;
  double eps;
  torch::Tensor lm_head;
  double scale, softcap;
  torch::Tensor proj, A, Bc;
  int64_t top_k, wide;  // candidates a slot: greedy rows, rows that sample
  torch::Tensor ids;
  std::vector<torch::Tensor> watched;
  std::vector<int64_t> versions;

  void context(const std::vector<torch::Tensor>& features, const std::vector<int64_t>& ctx_slots,
               const std::vector<int64_t>& starts, const std::vector<int64_t>& ends) const {
    const int64_t T = features[0].size(1);
    std::vector<float> taps;
    std::vector<int64_t> rows_slot, rows_pos;
    for (size_t i = 0; i < features.size(); ++i) {
      const torch::Tensor fi = features[i].to(torch::kFloat).contiguous();  // a no-op for the verifier's fp32 taps
      const float* f = fi.data_ptr<float>();
      TORCH_CHECK(fi.size(0) == ends[i] - starts[i], "context: features ", i, " are not rows [start, end)");
      taps.insert(taps.end(), f, f + (ends[i] - starts[i]) * T);
      for (int64_t p = starts[i]; p < ends[i]; ++p) { rows_slot.push_back(ctx_slots[i]); rows_pos.push_back(p); }
    }
    context_rows(taps.data(), int64_t(rows_pos.size()), T, rows_slot.data(), rows_pos.data(), kc, vc, cos, sin, fc,
                 hidden_norm, kv_w, kv_heads, hd, eps);
  }

  using Rows = std::vector<std::vector<int64_t>>;

  std::optional<Rows> propose(const std::vector<torch::Tensor>& features, const std::vector<int64_t>& ctx_slots,
                              const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
                              const std::vector<int64_t>& anchors, const std::vector<int64_t>& slots,
                              const std::vector<int64_t>& lens, int64_t B, int64_t S) const {
    if (!current()) return std::nullopt;
    return run(features, ctx_slots, starts, ends, anchors, slots, lens, B, S, nullptr, nullptr, nullptr);
  }

  // `propose` where requests sample: per request its temperature (0: greedy), seed, noise stream, the position of
  // its first draft and whether it is a rejection row -> (tokens, q_ids, q_probs), the q rows [R, S, wide]
  // meaningful for rejection rows only.
  std::optional<std::tuple<Rows, torch::Tensor, torch::Tensor>> propose_sampled(
      const std::vector<torch::Tensor>& features, const std::vector<int64_t>& ctx_slots,
      const std::vector<int64_t>& starts, const std::vector<int64_t>& ends, const std::vector<int64_t>& anchors,
      const std::vector<int64_t>& slots, const std::vector<int64_t>& lens, int64_t B, int64_t S,
      const std::vector<double>& temperatures, const std::vector<uint64_t>& seeds,
      const std::vector<uint64_t>& streams, const std::vector<uint64_t>& positions,
      const std::vector<bool>& rejection) const {
    if (!current()) return std::nullopt;
    const int64_t R = int64_t(anchors.size());
    TORCH_CHECK(int64_t(temperatures.size()) == R && int64_t(seeds.size()) == R && int64_t(streams.size()) == R &&
                int64_t(positions.size()) == R && int64_t(rejection.size()) == R, "one sampling entry per request");
    std::vector<RowSampling> sampling(R);
    for (int64_t r = 0; r < R; ++r) sampling[r] = {temperatures[r], seeds[r], streams[r], positions[r], rejection[r]};
    const int64_t width = std::min(std::max(wide, top_k), vocab_columns());
    auto q_ids = torch::zeros({R, S, width}, torch::kLong);
    auto q_probs = torch::zeros({R, S, width}, torch::kFloat);
    Rows tokens = run(features, ctx_slots, starts, ends, anchors, slots, lens, B, S, sampling.data(),
                      q_ids.data_ptr<int64_t>(), q_probs.data_ptr<float>());
    return std::make_tuple(std::move(tokens), q_ids, q_probs);
  }

 private:
  bool current() const {
    for (size_t i = 0; i < watched.size(); ++i)
      if (watched[i]._version() != versions[i]) return false;
    return true;
  }

  int64_t vocab_columns() const { return lm_head.dim() >= 3 ? lm_head.size(0) * 64 : lm_head.size(0); }

  Rows run(const std::vector<torch::Tensor>& features, const std::vector<int64_t>& ctx_slots,
           const std::vector<int64_t>& starts, const std::vector<int64_t>& ends, const std::vector<int64_t>& anchors,
           const std::vector<int64_t>& slots, const std::vector<int64_t>& lens, int64_t B, int64_t S,
           const RowSampling* sampling, int64_t* q_ids, float* q_probs) const {
    if (!features.empty()) context(features, ctx_slots, starts, ends);
    const int64_t R = int64_t(anchors.size()), H = embedding.size(1);
    const int64_t V = vocab_columns();  // LM head panels or [V, H]
    const float* emb = embedding.data_ptr<float>();
    float* x = scratch<10>(R * B * H);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < B; ++t) {
        const int64_t token = t ? mask_id : anchors[r];
        std::copy(emb + token * H, emb + (token + 1) * H, x + (r * B + t) * H);
      }
    block_rows(x, R, B, H, kc, vc, slots.data(), lens.data(), cos, sin, w, heads, kv_heads, hd, conv_taps, group,
               eps);
    float *rows = scratch<11>(R * S * H), *logits = scratch<12>(R * S * V);
    for (int64_t r = 0; r < R; ++r)
      std::copy(x + (r * B + 1) * H, x + (r * B + 1 + S) * H, rows + r * S * H);
    project(rows, R * S, H, lm_head, logits);
    if (scale != 0.0) for (int64_t i = 0; i < R * S * V; ++i) logits[i] *= float(scale);
    if (softcap != 0.0)
      for (int64_t i = 0; i < R * S * V; ++i) logits[i] = float(softcap) * std::tanh(logits[i] / float(softcap));
    std::vector<int64_t> flat(R * S);
    walk_rows(rows, logits, R, S, V, H, proj, A, Bc, anchors.data(), std::min(top_k, V),
              std::min(std::max(wide, top_k), V), column_ids(ids, V), flat.data(), sampling, q_ids, q_probs);
    Rows tokens(R);
    for (int64_t r = 0; r < R; ++r) tokens[r].assign(flat.begin() + r * S, flat.begin() + (r + 1) * S);
    return tokens;
  }
};

// The calls that take a while run without the GIL (they touch no Python object; see common/kernels/cpu_kernels.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block", &block, py::call_guard<py::gil_scoped_release>());
  m.def("context", &context, py::call_guard<py::gil_scoped_release>());
  m.def("walk", &walk, py::call_guard<py::gil_scoped_release>());
  m.def("walk_sampled", &walk_sampled, py::call_guard<py::gil_scoped_release>());
  py::class_<Proposer>(m, "Proposer")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                    std::vector<torch::Tensor>, torch::Tensor, int64_t, std::vector<torch::Tensor>, int64_t, int64_t,
                    int64_t, int64_t, int64_t, double, torch::Tensor, double, double, torch::Tensor, torch::Tensor,
                    torch::Tensor, int64_t, int64_t, torch::Tensor, std::vector<torch::Tensor>,
                    std::vector<int64_t>>())
      .def("__call__", &Proposer::propose, py::call_guard<py::gil_scoped_release>())
      .def("sampled", &Proposer::propose_sampled, py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16", &linear_bf16, py::call_guard<py::gil_scoped_release>());
  m.def("linear_i8", &linear_i8, py::call_guard<py::gil_scoped_release>());
  m.def("int8_supported", &int8_supported);
  m.def("bf16_supported", &bf16_supported);
  m.def("set_amx", &set_amx);
  m.def("amx_on", &amx_on);
}
