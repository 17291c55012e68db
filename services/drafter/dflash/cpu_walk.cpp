// The path selector's walk on the CPU (see cpu_block.py): the top-k candidates of each draft slot, the pairwise
// scores and the greedy or sampled pick; compiled after common/kernels/cpu_shared.cpp (dot16, philox_uniform) and before
// cpu_block.cpp, whose Proposer ends each proposal with `walk_rows`.
#include <cmath>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
// The top_k (<= 16) logits of a row of V (a multiple of 16) without a branch that depends on the values, the walk's
// hot spot otherwise: offering logits one by one (below) mispredicts, and on new logits every call (as in the loop)
// a walk takes nearly twice as long as on the same logits again. Here the maxima of the 16 lanes over
// the row are 16 distinct logits, so the least of them bounds the top_k-th from below; the columns at or above it
// (a few dozen) are compressed into a list in column order, and each one's rank (the logits above it, and the
// equal ones in lower columns) places it. Writes val / idx [top_k + 1] (the last a scratch entry for the ranks
// past top_k); returns top_k, or -1 (nothing written that counts) where a NaN or more than TOP_CAP ties at the
// bound leave it to the offers.
static constexpr int64_t TOP_CAP = 64;
static int64_t top_logits_ranked(const float* lg, int64_t V, int64_t top_k, float* val, int64_t* idx) {
  __m512 lanes = _mm512_loadu_ps(lg);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const __m512 x = _mm512_loadu_ps(lg + v);
    lanes = _mm512_max_ps(lanes, x);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  if (nan) return -1;
  const __m512 bound = _mm512_set1_ps(_mm512_reduce_min_ps(lanes));
  alignas(64) int32_t cols[TOP_CAP + 16];
  alignas(64) float vals[TOP_CAP + 16];
  int64_t m = 0;
  __m512i col = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t v = 0; v < V; v += 16, col = _mm512_add_epi32(col, _mm512_set1_epi32(16))) {
    const __m512 x = _mm512_loadu_ps(lg + v);
    const __mmask16 at = _mm512_cmp_ps_mask(x, bound, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_epi32(cols + m, at, col);
    _mm512_mask_compressstoreu_ps(vals + m, at, x);
    m += __builtin_popcount(at);
    if (m > TOP_CAP) return -1;
  }
  for (int64_t j = m; j < (m + 15) / 16 * 16; ++j) vals[j] = -INFINITY;  // never above or equal to a candidate
  for (int64_t i = 0; i < m; ++i) {
    const __m512 vi = _mm512_set1_ps(vals[i]);
    int64_t r = 0;
    for (int64_t c = 0; c < m; c += 16) {
      const __m512 vc = _mm512_load_ps(vals + c);
      const int64_t lower = std::min<int64_t>(std::max<int64_t>(i - c, 0), 16);  // lanes in columns below i's
      const __mmask16 before = __mmask16((1u << lower) - 1);
      r += __builtin_popcount(_mm512_cmp_ps_mask(vc, vi, _CMP_GT_OQ)) +
           __builtin_popcount(_mm512_cmp_ps_mask(vc, vi, _CMP_EQ_OQ) & before);
    }
    const int64_t at = std::min(r, top_k);
    val[at] = vals[i];
    idx[at] = cols[i];
  }
  return top_k;
}
#endif

// How a request's walk picks at each slot (distributions.draft_pick): temperature 0 the best score; else with
// z = score / temperature (fp64) and g the Gumbel noise of (seed, stream, position + slot) at each candidate's token,
// strict the argmax of z + g, rejection the argmax of log_softmax(z) + g, and q = softmax(z) written out.
struct RowSampling {
  double temperature;
  uint64_t seed, stream, position;
  bool rejection;
};

// The selector's walk: per slot the top_k logits (highest first, the lower token id first among equals; a row that
// samples, the top `wide`), then the candidate with the best U_t(b) + <A(prev) * (P h_t), B(b)> (or a sample,
// `sampling` per row where not null); the choice is the next slot's predecessor. hidden [R, S, H], logits [R, S, V],
// proj [rank, H], A and B [vocab, rank] -> [R, S]. ids (or null): the token id of each logit column, increasing (a
// draft vocabulary: V < vocab columns). q_ids / q_probs [R, S, wide] (where not null): a rejection row's candidates
// and q at every slot.
static void walk_rows(const float* hp, const float* lp, int64_t R, int64_t S, int64_t V, int64_t H,
                      const torch::Tensor& proj, const torch::Tensor& A, const torch::Tensor& Bc,
                      const int64_t* anchor, int64_t top_k, int64_t wide, const int64_t* ids, int64_t* tokens,
                      const RowSampling* sampling = nullptr, int64_t* q_ids = nullptr, float* q_probs = nullptr) {
  const int64_t rank = proj.size(0);
  const float* pw = proj.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* bp = Bc.data_ptr<float>();
  wide = std::max(wide, top_k);
  std::vector<float> val(wide + 1), q(rank), scores(wide);
  std::vector<double> z(wide);
  std::vector<int64_t> idx(wide + 1);
  const int64_t greedy_k = top_k;
  for (int64_t r = 0; r < R; ++r) {
    int64_t prev = anchor[r];
    const RowSampling* rs = sampling ? sampling + r : nullptr;
    const int64_t top_k = rs && rs->temperature > 0 ? wide : greedy_k;  // this row's candidates a slot
    for (int64_t t = 0; t < S; ++t) {
      const float* lg = lp + (r * S + t) * V;
      int64_t n = -1;
#if defined(__AVX512F__)
      if (top_k <= 16 && V >= top_k && V % 16 == 0) n = top_logits_ranked(lg, V, top_k, val.data(), idx.data());
#endif
      auto offer = [&](int64_t v) {
        if (n == top_k && !(lg[v] > val[n - 1])) return;
        int64_t at = n < top_k ? n++ : n - 1;
        while (at > 0 && lg[v] > val[at - 1]) { val[at] = val[at - 1]; idx[at] = idx[at - 1]; --at; }
        val[at] = lg[v]; idx[at] = v;
      };
      int64_t v = n < 0 ? 0 : V;  // the offers, where the ranks did not apply
      n = std::max<int64_t>(n, 0);
      for (; v < V && n < top_k; ++v) offer(v);
      // Once full, of a run of 16 logits only those that beat the current last are offered (one vector
      // compare), in column order; the others could not enter, as the last only rises.
      for (; v + 16 <= V; v += 16) {
#if defined(__AVX512F__)
        uint32_t beats = _mm512_cmp_ps_mask(_mm512_loadu_ps(lg + v), _mm512_set1_ps(val[n - 1]), _CMP_GT_OQ);
#elif defined(__AVX2__)
        const __m256 last = _mm256_set1_ps(val[n - 1]);
        uint32_t beats = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(lg + v), last, _CMP_GT_OQ)) |
                         _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(lg + v + 8), last, _CMP_GT_OQ)) << 8;
#else
        uint32_t beats = 0xFFFFu;
#endif
        for (; beats; beats &= beats - 1) offer(v + __builtin_ctz(beats));
      }
      for (; v < V; ++v) offer(v);
      if (ids) for (int64_t b = 0; b < n; ++b) idx[b] = ids[idx[b]];  // logit columns -> token ids
      const float* h = hp + (r * S + t) * H;
      for (int64_t j = 0; j < rank; ++j) q[j] = ap[prev * rank + j] * dot16(h, pw + j * H, H);
      int64_t best = 0;
      float best_score = -INFINITY;
      for (int64_t b = 0; b < n; ++b) {
        float pair = 0.f;
        for (int64_t j = 0; j < rank; ++j) pair += q[j] * bp[idx[b] * rank + j];
        scores[b] = val[b] + pair;
        if (scores[b] > best_score || b == 0) { best_score = scores[b]; best = b; }
      }
      if (rs && rs->temperature > 0) {
        double top = -INFINITY, sum = 0.0, best_key = -INFINITY;
        for (int64_t b = 0; b < n; ++b) top = std::max(top, z[b] = double(scores[b]) / rs->temperature);
        for (int64_t b = 0; b < n; ++b) sum += std::exp(z[b] - top);
        const double shift = rs->rejection ? top + std::log(sum) : 0.0;  // log_softmax, or z itself (strict)
        for (int64_t b = 0; b < n; ++b) {
          const double u = philox_uniform(rs->seed, rs->stream, rs->position + t, uint64_t(idx[b]));
          const double key = (z[b] - shift) - std::log(-std::log(u));
          if (key > best_key || b == 0) { best_key = key; best = b; }
        }
        if (rs->rejection && q_ids)
          for (int64_t b = 0; b < n; ++b) {
            q_ids[(r * S + t) * wide + b] = idx[b];
            q_probs[(r * S + t) * wide + b] = float(std::exp(z[b] - shift));
          }
      }
      prev = idx[best];
      tokens[r * S + t] = prev;
    }
  }
}

static const int64_t* column_ids(const torch::Tensor& ids, int64_t columns) {
  if (!ids.numel()) return nullptr;
  TORCH_CHECK(ids.numel() == columns && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "draft vocabulary: one int64 token id per logit column");
  return ids.data_ptr<int64_t>();
}

torch::Tensor walk(torch::Tensor hidden, torch::Tensor logits, torch::Tensor proj, torch::Tensor A, torch::Tensor Bc,
                   torch::Tensor anchor, int64_t top_k, torch::Tensor ids) {
  const int64_t R = logits.size(0), S = logits.size(1);
  auto out = torch::empty({R, S}, anchor.options());
  walk_rows(hidden.data_ptr<float>(), logits.data_ptr<float>(), R, S, logits.size(2), hidden.size(2), proj, A, Bc,
            anchor.data_ptr<int64_t>(), top_k, top_k, column_ids(ids, logits.size(2)), out.data_ptr<int64_t>());
  return out;
}

// `walk` where requests sample (RowSampling per request, as Proposer.propose_sampled takes them; a row that samples
// walks over the top `wide` candidates) -> (tokens [R, S], q_ids, q_probs [R, S, wide]: the candidates and q of every
// slot, meaningful in rejection rows).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> walk_sampled(
    torch::Tensor hidden, torch::Tensor logits, torch::Tensor proj, torch::Tensor A, torch::Tensor Bc,
    torch::Tensor anchor, int64_t top_k, int64_t wide, torch::Tensor ids, const std::vector<double>& temperatures,
    const std::vector<uint64_t>& seeds, const std::vector<uint64_t>& streams, const std::vector<uint64_t>& positions,
    const std::vector<bool>& rejection) {
  const int64_t R = logits.size(0), S = logits.size(1);
  TORCH_CHECK(int64_t(temperatures.size()) == R && int64_t(seeds.size()) == R && int64_t(streams.size()) == R &&
              int64_t(positions.size()) == R && int64_t(rejection.size()) == R, "one sampling entry per request");
  std::vector<RowSampling> sampling(R);
  for (int64_t r = 0; r < R; ++r) sampling[r] = {temperatures[r], seeds[r], streams[r], positions[r], rejection[r]};
  auto out = torch::empty({R, S}, anchor.options());
  wide = std::min(std::max(wide, top_k), logits.size(2));
  auto q_ids = torch::zeros({R, S, wide}, torch::kLong);
  auto q_probs = torch::zeros({R, S, wide}, torch::kFloat);
  walk_rows(hidden.data_ptr<float>(), logits.data_ptr<float>(), R, S, logits.size(2), hidden.size(2), proj, A, Bc,
            anchor.data_ptr<int64_t>(), top_k, wide, column_ids(ids, logits.size(2)), out.data_ptr<int64_t>(),
            sampling.data(), q_ids.data_ptr<int64_t>(), q_probs.data_ptr<float>());
  return std::make_tuple(out, q_ids, q_probs);
}
