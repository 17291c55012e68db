// common/kernels/cpu_kernels.py's own functions, compiled after cpu_shared.cpp.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed) {
  auto y = torch::empty({x.size(0), packed.size(0) * 64}, x.options());
  linear_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

// The index of each row's largest value (the first among equals; a NaN counts as the largest, as in
// torch.argmax); x [N, V] contiguous fp32. One vector pass finds the maximum and whether the row has a
// NaN, a second the first index holding it.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
  const int64_t N = x.size(0), V = x.size(1), whole = V / VW * VW;
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> out(N);
  for (int64_t n = 0; n < N; ++n) {
    const float* row = xp + n * V;
    float value = row[0];
    bool nan = false;
    if (whole) {
      vf mx = loadv<vf>(row);
      vif bad = mx != mx;
      for (int64_t v = VW; v < whole; v += VW) {
        const vf a = loadv<vf>(row + v);
        bad |= a != a;
        mx = a > mx ? a : mx;
      }
      for (int i = 0; i < VW; ++i) { nan |= bad[i] != 0; value = mx[i] > value ? mx[i] : value; }
    }
    for (int64_t v = whole; v < V; ++v) { nan |= row[v] != row[v]; value = row[v] > value ? row[v] : value; }
    int64_t best = 0;
    if (nan) { while (row[best] == row[best]) ++best; }
    else { while (!(row[best] == value)) ++best; }
    out[n] = best;
  }
  return out;
}

// Attention of short query blocks over a paged KV cache, read in place (no gathered copy, no mask):
// q [B, H, T, hd] (hd contiguous), kc / vc one layer's cache [blocks, KV, block_len, hd] contiguous, tables [B, nb]:
// row b's key j lies in block tables[b, j >> shift] at j & (2^shift - 1) (a slot cache is one block per slot:
// tables [B, 1], shift past any position); pos [B, T]: query (b, t) sees keys 0..pos[b, t]; head h reads KV head
// h / (H / KV). -> [B, T, H * hd]. Tasks: chunks of a KV head's group x T queries (attend_head).
torch::Tensor cached_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                               torch::Tensor pos, double scale, int64_t shift) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t KV = kc.size(1), BL = kc.size(2), group = H / KV, nq = group * T, nb = tables.size(1);
  const int64_t L = std::min(nb << shift, shift >= 40 ? BL : nb * BL), mask = (int64_t(1) << shift) - 1;
  const int64_t chunks = (nq + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
  TORCH_CHECK(q.stride(3) == 1 && kc.is_contiguous() && vc.is_contiguous() && H % KV == 0 && tables.is_contiguous() &&
              tables.size(0) == B && (shift >= 40 || (int64_t(1) << shift) == BL), "cached_attention: unsupported layout");
  auto out = torch::empty({B, T, H * hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t *tp = tables.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), row = L + 16;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(ATTEND_CHUNK * row);
    int64_t n[ATTEND_CHUNK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (KV * chunks), g = task / chunks % KV, first = task % chunks * ATTEND_CHUNK;
      const int64_t count = std::min(ATTEND_CHUNK, nq - first);
      const int64_t* table = tp + b * nb;
      // Query first + i of the KV head: head g * group + (first + i) / T, position index (first + i) % T.
      for (int64_t i = 0; i < count; ++i) n[i] = std::min(pp[b * T + (first + i) % T] + 1, L);
      auto query = [&](int64_t i) { return qp + b * qs0 + (g * group + (first + i) / T) * qs1 + (first + i) % T * qs2; };
      auto output = [&](int64_t i) { return op + (b * T + (first + i) % T) * H * hd + (g * group + (first + i) / T) * hd; };
      auto at = [&](int64_t j) { return ((table[j >> shift] * KV + g) * BL + (j & mask)) * hd; };
      auto key = [&](int64_t j) { return kp + at(j); };
      auto value = [&](int64_t j) { return vp + at(j); };
      attend_head_hd(hd, query, key, value, output, n, count, scores.data(), row, (float)scale);
    }
  });
  return out;
}

// fn(begin, end) over n independent rows: split between two threads from PARALLEL_ROWS rows on (a prefill chunk, a
// batch's verify), each row computed as alone. On one thread the norms and the q/k rotation are a noticeable share
// of a batch's verify.
constexpr int64_t PARALLEL_ROWS = 16;
template <typename F>
static void over_rows(int64_t n, const F& fn) {
  at::parallel_for(0, n, n >= PARALLEL_ROWS ? (n + 1) / 2 : std::max<int64_t>(n, 1), fn);
}

// The RMS norm of every row (last dim D) of x [..., D] (contiguous fp32, D % 16 == 0) by w [D] -> a new
// tensor shaped like x (rms_rows: one call where torch's CPU rms_norm runs seven).
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == D && D % 16 == 0, "rms_norm_rows: unsupported layout");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(x.numel() / D, [&](int64_t begin, int64_t end) {
    rms_rows(xp + begin * D, wp, yp + begin * D, end - begin, D, (float)eps);
  });
  return y;
}

// The attention's q and k heads: from qkv [B, T, heads + 2 kv_heads, hd] (hd contiguous), each q head
// normed by q_w and each k head by k_w ([hd]; empty: no norm), then rotated at its position
// (pos [B, T] into cos / sin [max_len, hd]) -> [B, heads + kv_heads, T, hd], the layout attention reads.
torch::Tensor qk_norm_rope(torch::Tensor qkv, torch::Tensor q_w, torch::Tensor k_w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor pos, int64_t heads, int64_t kv_heads, double eps) {
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(3), G = heads + kv_heads;
  TORCH_CHECK(qkv.stride(3) == 1 && qkv.size(2) == heads + 2 * kv_heads && hd % 16 == 0 && hd <= 1024 &&
              cos.is_contiguous() && sin.is_contiguous() && pos.is_contiguous(), "qk_norm_rope: unsupported layout");
  auto out = torch::empty({B, G, T, hd}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float* qw = q_w.numel() ? q_w.data_ptr<float>() : nullptr;
  const float* kw = k_w.numel() ? k_w.data_ptr<float>() : nullptr;
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < cos.size(0), "qk_norm_rope: position ", pp[i], " outside the table");
  float* op = out.data_ptr<float>();
  over_rows(B * T, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T, at = pp[bt] * hd;
      for (int64_t g = 0; g < G; ++g) {
        float* h = op + ((b * G + g) * T + t) * hd;
        __builtin_memcpy(h, xp + b * qkv.stride(0) + t * qkv.stride(1) + g * qkv.stride(2), hd * sizeof(float));
        norm_rope(h, g < heads ? qw : kw, cp + at, sp + at, hd, (float)eps);
      }
    }
  });
  return out;
}

// torch's exp on AVX-512 (Sleef, in libtorch_cpu), so that silu_mul below computes what F.silu does; weak: where
// a torch does not export it, silu_mul uses ATen's silu.
#if defined(__AVX512F__)
extern "C" v16 Sleef_expf16_u10(v16) __attribute__((weak));
#endif

// silu(gate) * up for gate_up [N, 2 F] (contiguous fp32, gate the first F of each row) -> [N, F]: ATen's silu formula
// x / (1 + exp(-x)) with its AVX-512 exp, then the product, in one pass (ATen's three operations pay their dispatch
// and a strided read of the gate, a visible share of a decode's forward).
// Bitwise F.silu(gate) * up (tested) for F a multiple of 32, the rows torch computes in vectors; other widths go to
// ATen. The decoder's two paths both call it.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  const int64_t F = gate_up.size(-1) / 2, N = gate_up.numel() / std::max<int64_t>(2 * F, 1);
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: unsupported layout");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = F;
#if defined(__AVX512F__)
  if (Sleef_expf16_u10 != nullptr && F % 32 == 0) {  // torch's loop: 32 at a time, the rest without Sleef
    auto out = torch::empty(sizes, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    over_rows(N, [&](int64_t begin, int64_t end) {
      const v16 one = v16{} + 1.f;
      for (int64_t n = begin; n < end; ++n)
        for (int64_t i = 0; i < F; i += 16) {
          const v16 g = load16(gp + n * 2 * F + i), u = load16(gp + n * 2 * F + F + i);
          const v16 y = g / (one + Sleef_expf16_u10(-g)) * u;
          __builtin_memcpy(op + n * F + i, &y, sizeof y);
        }
    });
    return out;
  }
#endif
  auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

// The embedding rows of tokens [B, T] (contiguous int64) from emb [V, D] -> [B, T, D]: index_select's result, a
// copy a row (index_select's dispatch is a visible share of a decode's forward).
static torch::Tensor embed_rows(const torch::Tensor& tokens, const torch::Tensor& emb) {
  const int64_t N = tokens.numel(), V = emb.size(0), D = emb.size(1);
  TORCH_CHECK(tokens.is_contiguous() && emb.is_contiguous(), "decoder_rows: unsupported embedding layout");
  auto x = torch::empty({tokens.size(0), tokens.size(1), D}, emb.options());
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const float* ep = emb.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(0 <= tp[n] && tp[n] < V, "decoder_rows: token id ", tp[n], " outside the vocabulary of ", V);
    std::memcpy(xp + n * D, ep + tp[n] * D, D * sizeof(float));
  }
  return x;
}

// Each row's real tokens' K (the k heads of qk [B, heads + kv_heads, T, hd]) and V (of qkv [B, T, heads + 2 kv_heads,
// hd]) into one layer's cache kc / vc [blocks, kv_heads, block_len, hd] at positions [starts[b], starts[b] + lengths[b])
// of row b's blocks (tables, shift: as cached_attention reads them): plain copies, a run of positions within a block
// at a time (ATen's views and copies cost more than the copying at a decode's sizes).
static void store_kv(const torch::Tensor& qk, const torch::Tensor& qkv, torch::Tensor& kc, torch::Tensor& vc,
                     const torch::Tensor& tables, int64_t shift, const std::vector<int64_t>& starts,
                     const std::vector<int64_t>& lengths, int64_t heads, int64_t kv_heads) {
  const int64_t T = qkv.size(1), hd = qkv.size(3), BL = kc.size(2), nb = tables.size(1);
  const int64_t mask = (int64_t(1) << shift) - 1;
  TORCH_CHECK(qk.is_contiguous() && qkv.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(),
              "decoder_rows: unsupported K/V layout");
  const float *qkp = qk.data_ptr<float>(), *vp = qkv.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float *kp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
  for (size_t b = 0; b < starts.size(); ++b)
    for (int64_t t = 0; t < lengths[b];) {
      const int64_t p = starts[b] + t, run = std::min(lengths[b] - t, shift >= 40 ? lengths[b] - t : BL - (p & mask));
      const int64_t block = tp[b * nb + (p >> shift)];
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t at = ((block * kv_heads + g) * BL + (p & mask)) * hd;
        std::memcpy(kp + at, qkp + ((b * (heads + kv_heads) + heads + g) * T + t) * hd, run * hd * sizeof(float));
        for (int64_t r = 0; r < run; ++r)  // V: head heads + kv_heads + g of token t + r's qkv row
          std::memcpy(vcp + at + r * hd, vp + ((b * T + t + r) * (heads + 2 * kv_heads) + heads + kv_heads + g) * hd,
                      hd * sizeof(float));
      }
      t += run;
    }
}

// The real tokens' rows of x [B, T, D] into tap_dest [blocks, block_len, n_taps * D] at their positions (through the
// rows' block tables, as their K/V), columns [tap * D, (tap + 1) * D): where a forward's caller keeps the tap
// features, without a concatenation and an indexed copy on the way there.
static void store_tap(const torch::Tensor& x, torch::Tensor& tap_dest, int64_t tap, const torch::Tensor& tables,
                      int64_t shift, const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) {
  const int64_t T = x.size(1), D = x.size(2), BL = tap_dest.size(1), W = tap_dest.size(2), nb = tables.size(1);
  const int64_t mask = (int64_t(1) << shift) - 1;
  const float* xp = x.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* dp = tap_dest.data_ptr<float>();
  for (size_t b = 0; b < starts.size(); ++b)
    for (int64_t t = 0; t < lengths[b]; ++t) {
      const int64_t p = starts[b] + t;
      std::memcpy(dp + (tp[b * nb + (p >> shift)] * BL + (p & mask)) * W + tap * D, xp + (b * T + t) * D,
                  D * sizeof(float));
    }
}

// x + y for y [N, D] fresh from small_linear, into y (the sum ATen's add computes, without its allocation and
// dispatch) -> y viewed as x.
static torch::Tensor add_residual(const torch::Tensor& x, torch::Tensor y) {
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(x.is_contiguous() && x.numel() == y.numel(), "decoder_rows: unsupported residual layout");
  for (int64_t i = 0; i < y.numel(); ++i) yp[i] = xp[i] + yp[i];
  return y.view(x.sizes());
}

// A decoder's layers over rows of real tokens (tokens [B, T]; row b's first lengths[b] are real, the rest padding)
// in one call: per layer the norms, the packed linear products, q/k norm with RoPE, each row's real K/V stored at
// [starts[b], starts[b] + lengths[b]) of its blocks (tables [B, nb], shift: as cached_attention), attention over the cache and the MLP, with the same
// kernels and arithmetic as the module path (common/models/decoder.py), so the result is bitwise the module's.
// w: 8 tensors a layer (input norm, q|k|v panels, q norm, k norm, o panels, post-attention norm, gate|up panels,
// down panels). Returns [final-normed hidden [B, T, D], the outputs of the layers in `taps` (ascending; tap L is the
// final-normed hidden itself)]; with a tap_dest ([blocks, block_len, n_taps * D] fp32, contiguous, the K/V's blocks;
// empty: none) the taps' real rows go there instead.
std::vector<torch::Tensor> decoder_rows(torch::Tensor tokens, torch::Tensor emb, std::vector<torch::Tensor> w,
                                        torch::Tensor final_w, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                        torch::Tensor tables, int64_t shift,
                                        std::vector<int64_t> starts, std::vector<int64_t> lengths,
                                        std::vector<int64_t> taps, torch::Tensor tap_dest, int64_t heads,
                                        int64_t kv_heads, int64_t hd, double eps) {
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T, D = emb.size(1), L = k_cache.size(0);
  TORCH_CHECK((int64_t)w.size() == 8 * L && tables.dim() == 2 && tables.size(0) == B && tables.is_contiguous() &&
              (int64_t)starts.size() == B && (int64_t)lengths.size() == B, "decoder_rows: unsupported input");
  const int64_t blocks = k_cache.size(1), BL = k_cache.size(3), nb = tables.size(1);
  const int64_t reach = shift >= 40 ? BL : nb * BL;  // positions a row's table covers
  const bool to_dest = tap_dest.numel() > 0;
  TORCH_CHECK(!to_dest || (tap_dest.is_contiguous() && tap_dest.scalar_type() == at::kFloat && tap_dest.dim() == 3 &&
                           tap_dest.size(2) == (int64_t)taps.size() * D && tap_dest.size(1) == BL &&
                           tap_dest.size(0) >= blocks),
              "decoder_rows: unsupported tap_dest");
  TORCH_CHECK(shift >= 40 || (int64_t(1) << shift) == BL, "decoder_rows: block length ", BL, " is not 2^", shift);
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 < lengths[b] && lengths[b] <= T && 0 <= starts[b] && starts[b] + lengths[b] <= reach,
                "decoder_rows: row ", b, " does not fit its blocks");
    for (int64_t j = 0; j <= (shift >= 40 ? 0 : (starts[b] + lengths[b] - 1) >> shift); ++j)
      TORCH_CHECK(0 <= tp[b * nb + j] && tp[b * nb + j] < blocks, "decoder_rows: row ", b, " names block ",
                  tp[b * nb + j], " of ", blocks);
  }
  auto x = embed_rows(tokens, emb);
  auto pos = positions.contiguous();
  std::vector<torch::Tensor> out{torch::Tensor()};
  size_t tap = 0;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = &w[8 * l];
    torch::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    auto qkv = small_linear(rms_norm_rows(x, p[0], eps).reshape({N, D}), p[1]).view({B, T, heads + 2 * kv_heads, hd});
    auto qk = qk_norm_rope(qkv, p[2], p[3], cos, sin, pos, heads, kv_heads, eps);  // [B, heads + kv_heads, T, hd]
    store_kv(qk, qkv, kc, vc, tables, shift, starts, lengths, heads, kv_heads);  // padding: computed, never stored
    auto att = cached_attention(qk.narrow(1, 0, heads), kc, vc, tables, pos, 1.0 / std::sqrt((double)hd), shift);
    x = add_residual(x, small_linear(att.reshape({N, heads * hd}), p[4]));
    auto act = silu_mul(small_linear(rms_norm_rows(x, p[5], eps).reshape({N, D}), p[6]));
    x = add_residual(x, small_linear(act, p[7]));
    if (tap < taps.size() && taps[tap] == l) {
      if (to_dest) store_tap(x, tap_dest, (int64_t)tap, tables, shift, starts, lengths);
      else out.push_back(x);
      ++tap;
    }
  }
  out[0] = rms_norm_rows(x, final_w, eps);
  if (tap < taps.size() && taps[tap] == L) {
    if (to_dest) store_tap(out[0], tap_dest, (int64_t)tap, tables, shift, starts, lengths);
    else out.push_back(out[0]);
  }
  return out;
}

// The calls that take a while run without the GIL (they touch no Python object), so a server's other threads (its
// gRPC and asyncio work, streaming the last step's tokens) go on during a forward.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_rows", &decoder_rows, py::call_guard<py::gil_scoped_release>());
  m.def("small_linear", &small_linear, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows);
  m.def("gumbel_argmax", &gumbel_argmax, py::call_guard<py::gil_scoped_release>());
  m.def("residual_argmax", &residual_argmax, py::call_guard<py::gil_scoped_release>());
  m.def("gumbel_rows", &gumbel_rows);
  m.def("logsumexp_row", &logsumexp_row, py::call_guard<py::gil_scoped_release>());
  m.def("warp_floor", &warp_floor, py::call_guard<py::gil_scoped_release>());
  m.def("philox_uniform", &philox_uniform);
  m.def("silu_mul", &silu_mul);
  m.def("cached_attention", &cached_attention);
  m.def("rms_norm_rows", &rms_norm_rows);
  m.def("qk_norm_rope", &qk_norm_rope);
}
