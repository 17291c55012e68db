// common/cpu_kernels.py's own functions, compiled after cpu_shared.cpp.
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

// Attention of short query blocks over the slot KV cache, read in place (no gathered copy, no mask):
// q [B, H, T, hd] (hd contiguous), kc / vc one layer's cache [slots, KV, max_len, hd] contiguous,
// slots [B], pos [B, T]: query (b, t) sees keys 0..pos[b, t] of slot slots[b]; head h reads KV head
// h / (H / KV). -> [B, T, H * hd]. Tasks: chunks of a KV head's group x T queries (attend_head).
torch::Tensor cached_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots,
                               torch::Tensor pos, double scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t KV = kc.size(1), L = kc.size(2), group = H / KV, nq = group * T;
  const int64_t chunks = (nq + ATTEND_CHUNK - 1) / ATTEND_CHUNK;
  TORCH_CHECK(q.stride(3) == 1 && kc.is_contiguous() && vc.is_contiguous() && H % KV == 0, "cached_attention: unsupported layout");
  auto out = torch::empty({B, T, H * hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t *sp = slots.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), row = L + 16;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KV * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(ATTEND_CHUNK * row);
    int64_t n[ATTEND_CHUNK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (KV * chunks), g = task / chunks % KV, first = task % chunks * ATTEND_CHUNK;
      const int64_t count = std::min(ATTEND_CHUNK, nq - first), head = (sp[b] * KV + g) * L * hd;
      // Query first + i of the KV head: head g * group + (first + i) / T, position index (first + i) % T.
      for (int64_t i = 0; i < count; ++i) n[i] = std::min(pp[b * T + (first + i) % T] + 1, L);
      auto query = [&](int64_t i) { return qp + b * qs0 + (g * group + (first + i) / T) * qs1 + (first + i) % T * qs2; };
      auto output = [&](int64_t i) { return op + (b * T + (first + i) % T) * H * hd + (g * group + (first + i) / T) * hd; };
      auto key = [&](int64_t j) { return kp + head + j * hd; };
      auto value = [&](int64_t j) { return vp + head + j * hd; };
      attend_head_hd(hd, query, key, value, output, n, count, scores.data(), row, (float)scale);
    }
  });
  return out;
}

// The RMS norm of every row (last dim D) of x [..., D] (contiguous fp32, D % 16 == 0) by w [D] -> a new
// tensor shaped like x (rms_rows: one call where torch's CPU rms_norm runs seven).
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == D && D % 16 == 0, "rms_norm_rows: unsupported layout");
  auto y = torch::empty_like(x);
  rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.numel() / D, D, (float)eps);
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
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t at = pp[b * T + t] * hd;
      for (int64_t g = 0; g < G; ++g) {
        float* h = op + ((b * G + g) * T + t) * hd;
        __builtin_memcpy(h, xp + b * qkv.stride(0) + t * qkv.stride(1) + g * qkv.stride(2), hd * sizeof(float));
        norm_rope(h, g < heads ? qw : kw, cp + at, sp + at, hd, (float)eps);
      }
    }
  return out;
}

// A decoder's layers over rows of real tokens (tokens [B, T]; row b's first lengths[b] are real, the rest padding)
// in one call: per layer the norms, the packed linear products, q/k norm with RoPE, each row's real K/V stored at
// [starts[b], starts[b] + lengths[b]) of its slot host_slots[b], attention over the cache and the MLP, with the same
// kernels and ATen operations as the module path (common/decoder.py), so the result is bitwise the module's.
// w: 8 tensors a layer (input norm, q|k|v panels, q norm, k norm, o panels, post-attention norm, gate|up panels,
// down panels). Returns [final-normed hidden [B, T, D], the outputs of the layers in `taps` (ascending)].
std::vector<torch::Tensor> decoder_rows(torch::Tensor tokens, torch::Tensor emb, std::vector<torch::Tensor> w,
                                        torch::Tensor final_w, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                        torch::Tensor slots, std::vector<int64_t> host_slots,
                                        std::vector<int64_t> starts, std::vector<int64_t> lengths,
                                        std::vector<int64_t> taps, int64_t heads, int64_t kv_heads, int64_t hd,
                                        double eps) {
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T, D = emb.size(1), L = k_cache.size(0);
  TORCH_CHECK((int64_t)w.size() == 8 * L && (int64_t)host_slots.size() == B && (int64_t)starts.size() == B &&
              (int64_t)lengths.size() == B, "decoder_rows: unsupported input");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 < lengths[b] && lengths[b] <= T && 0 <= starts[b] && starts[b] + lengths[b] <= k_cache.size(3),
                "decoder_rows: row ", b, " does not fit its slot");
  auto x = emb.index_select(0, tokens.reshape(-1)).reshape({B, T, D});
  auto pos = positions.contiguous();
  std::vector<torch::Tensor> out{torch::Tensor()};
  size_t tap = 0;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = &w[8 * l];
    const torch::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    auto qkv = small_linear(rms_norm_rows(x, p[0], eps).reshape({N, D}), p[1]).view({B, T, heads + 2 * kv_heads, hd});
    auto qk = qk_norm_rope(qkv, p[2], p[3], cos, sin, pos, heads, kv_heads, eps);  // [B, heads + kv_heads, T, hd]
    for (int64_t b = 0; b < B; ++b) {  // the real tokens' K/V only: padding is computed, never stored
      const int64_t n = lengths[b];
      kc.select(0, host_slots[b]).narrow(1, starts[b], n).copy_(qk[b].narrow(0, heads, kv_heads).narrow(1, 0, n));
      vc.select(0, host_slots[b]).narrow(1, starts[b], n).copy_(
          qkv[b].narrow(1, heads + kv_heads, kv_heads).transpose(0, 1).narrow(1, 0, n));
    }
    auto att = cached_attention(qk.narrow(1, 0, heads), kc, vc, slots, pos, 1.0 / std::sqrt((double)hd));
    x = x + small_linear(att.reshape({N, heads * hd}), p[4]).view({B, T, D});
    auto gate_up = small_linear(rms_norm_rows(x, p[5], eps).reshape({N, D}), p[6]).view({B, T, -1}).chunk(2, -1);
    auto act = at::silu(gate_up[0]) * gate_up[1];
    x = x + small_linear(act.reshape({N, act.size(-1)}), p[7]).view({B, T, D});
    if (tap < taps.size() && taps[tap] == l) {
      out.push_back(x);
      ++tap;
    }
  }
  out[0] = rms_norm_rows(x, final_w, eps);
  return out;
}

// The calls that take a while run without the GIL (they touch no Python object), so a server's other threads (its
// gRPC and asyncio work, streaming the last step's tokens) go on during a forward.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_rows", &decoder_rows, py::call_guard<py::gil_scoped_release>());
  m.def("small_linear", &small_linear, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows);
  m.def("cached_attention", &cached_attention);
  m.def("rms_norm_rows", &rms_norm_rows);
  m.def("qk_norm_rope", &qk_norm_rope);
}
