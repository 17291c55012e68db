// The sampling rule's work over a vocabulary row (common/runtime/distributions.py: `sample`, `LogProbRows`), on the noise of
// cpu_shared.cpp (`philox_block`).

#include <algorithm>

// A row of scores: fp32 logits over a temperature (z = double(x) / t, torch's `x.double() / t`) or fp64 scores;
// scores below `floor` (what top-k and top-p cut, `warp_floor`) count as -inf.
struct ScoreRow {
  const float* f32;
  const double* f64;
  double divisor;
  int64_t V;
  double floor;
  explicit ScoreRow(const torch::Tensor& row, double divisor_, double floor_ = -INFINITY)
      : f32(row.scalar_type() == torch::kFloat ? row.data_ptr<float>() : nullptr),
        f64(row.scalar_type() == torch::kDouble ? row.data_ptr<double>() : nullptr), divisor(divisor_), V(row.numel()),
        floor(floor_) {
    TORCH_CHECK(row.dim() == 1 && row.is_contiguous() && V > 0 && (f32 || f64) && divisor > 0,
                "score row: one contiguous fp32 or fp64 row and a positive divisor");
  }
  double operator[](int64_t v) const {
    const double z = f32 ? double(f32[v]) / divisor : f64[v] / divisor;
    return z >= floor ? z : -INFINITY;
  }
  // The largest score over [begin, end) and the first index holding it (-inf and begin where none is above -inf).
  std::pair<double, int64_t> max(int64_t begin, int64_t end) const {
    int64_t best = begin;
    if (f32) {
      for (int64_t v = begin + 1; v < end; ++v)
        if (f32[v] > f32[best]) best = v;
    } else {
      for (int64_t v = begin + 1; v < end; ++v)
        if (f64[v] > f64[best]) best = v;
    }
    return {(*this)[best], best};  // division by a positive number keeps the order
  }
};

struct Pick {
  double key;
  int64_t index;
  bool beats(const Pick& o) const { return key > o.key || (key == o.key && index < o.index); }
};

static constexpr int64_t NOISE_CHUNK = 16;  // uniforms per chunk: 4 Philox blocks

// Tokens whose scores replace the row's: ids ascending, each once, and their scores.
struct Overrides {
  std::vector<int64_t> ids;
  std::vector<double> values;
  bool has(int64_t v) const { return !ids.empty() && std::binary_search(ids.begin(), ids.end(), v); }
};

// distributions.sample: argmax_v(z_v - log(-log(u_v))) over a score row, u_v uniform offset + v of (seed, stream,
// position), the first index among equal keys; overridden tokens take their override's score instead of the row's.
// A token is skipped without its logs where its key provably falls short of the best so far: -log(u) >= 1 - u, so
// key_v >= best needs 1 - u_v <= exp(z_v - best) (with a 1e-6 margin for rounding). The row goes in chunks of 16
// uniforms: a chunk whose best score is 40 below the best key draws no noise (1 - u >= 2^-53 > exp(-40)); in the rest,
// one exp of the chunk's best score rules out most tokens on their uniform alone. Long rows split over the threads
// (each its own best, then the best of those): the same pick at any thread count.
static int64_t gumbel_pick(const ScoreRow& z, uint64_t seed, uint64_t position, uint64_t stream, int64_t offset,
                           const Overrides& over) {
  const int64_t V = z.V, n_over = int64_t(over.ids.size());
  TORCH_CHECK(offset >= 0, "gumbel_argmax: a negative offset");
  auto noise = [&](int64_t v) {
    return -std::log(-std::log(philox_uniform(seed, stream, position, uint64_t(offset + v))));
  };
  // The start: the best score outside the overrides (the row's max between them), or an override's where higher.
  Pick start{-INFINITY, 0};
  for (int64_t j = 0, begin = 0; j <= n_over; ++j) {
    const int64_t end = j < n_over ? over.ids[j] : V;
    TORCH_CHECK(end >= 0 && end <= V && (j == n_over || end < V), "gumbel_argmax: token ", end, " outside the row");
    if (end > begin) {
      auto [score, at] = z.max(begin, end);
      if (score > start.key) start = {score, at};
    }
    begin = std::max(begin, end + 1);
  }
  for (int64_t j = 0; j < n_over; ++j)
    if (over.values[j] > start.key) start = {over.values[j], over.ids[j]};  // ids ascending: the first of equals stays
  if (!(start.key > -INFINITY)) return 0;  // nothing possible (torch's argmax of all -inf: the first)
  Pick best{start.key + noise(start.index), start.index};
  for (int64_t j = 0; j < n_over; ++j)  // the overrides: their own scores
    if (over.values[j] > -INFINITY) {
      const Pick p{over.values[j] + noise(over.ids[j]), over.ids[j]};
      if (p.beats(best)) best = p;
    }
  // The chunks: index i = offset + v, chunk c covers i in [16 c, 16 c + 16).
  const int64_t first_chunk = offset / NOISE_CHUNK, last_chunk = (offset + V - 1) / NOISE_CHUNK;
  const int64_t n_chunks = last_chunk - first_chunk + 1;
  auto scan = [&](int64_t c0, int64_t c1, Pick mine) {
    uint64_t words[NOISE_CHUNK];
    for (int64_t c = first_chunk + c0; c < first_chunk + c1; ++c) {
      const int64_t begin = std::max<int64_t>(c * NOISE_CHUNK - offset, 0);
      const int64_t end = std::min<int64_t>((c + 1) * NOISE_CHUNK - offset, V);
      const double top = z.max(begin, end).first - mine.key;
      if (!(top >= -40.0)) continue;
      for (int b = 0; b < 4; ++b) philox_block(seed, stream, position, uint64_t(c) * 4 + b, words + 4 * b);
      const double bound = std::exp(top) * (1.0 + 1e-6);  // no token of the chunk is above its best
      for (int64_t v = begin; v < end; ++v) {
        const double u = philox_double(words[(offset + v) % NOISE_CHUNK]);
        if (1.0 - u > bound) continue;
        const double d = z[v] - mine.key;
        if (1.0 - u > std::exp(d) * (1.0 + 1e-6) || over.has(v)) continue;
        const Pick p{z[v] + -std::log(-std::log(u)), v};
        if (p.beats(mine)) mine = p;
      }
    }
    return mine;
  };
  const int64_t parts = V >= 32768 ? std::min<int64_t>(at::get_num_threads(), n_chunks) : 1;
  if (parts <= 1) return scan(0, n_chunks, best).index;
  std::vector<Pick> found(parts, best);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) found[p] = scan(n_chunks * p / parts, n_chunks * (p + 1) / parts, best);
  });
  for (const Pick& p : found)
    if (p.beats(best)) best = p;
  return best.index;
}

int64_t gumbel_argmax(torch::Tensor row, double divisor, double floor, uint64_t seed, uint64_t position,
                      uint64_t stream, int64_t offset) {
  return gumbel_pick(ScoreRow(row, divisor, floor), seed, position, stream, offset, Overrides{});
}

// The rejection rule's recovered token: a sample of max(0, p - q), p = exp(z - lse) over the row, q over its tokens
// q_ids (fp32 or fp64 q_probs; a token listed twice counts its probabilities together) and zero elsewhere: the row
// with q's tokens overridden by log(max(0, p - q)) + lse. Where the residual has no mass (sum min(p, q) >= 1, p == q),
// a sample of p itself.
int64_t residual_argmax(torch::Tensor row, double divisor, double floor, double lse, torch::Tensor q_ids,
                        torch::Tensor q_probs, uint64_t seed, uint64_t position, uint64_t stream, int64_t offset) {
  const ScoreRow z(row, divisor, floor);
  TORCH_CHECK(q_ids.dim() == 1 && q_ids.scalar_type() == torch::kLong && q_probs.dim() == 1
              && q_probs.numel() == q_ids.numel(), "residual_argmax: q's token ids (int64) and their probabilities");
  auto ids = q_ids.contiguous();
  auto probs = q_probs.to(torch::kDouble).contiguous();
  std::vector<std::pair<int64_t, double>> q;
  for (int64_t j = 0; j < ids.numel(); ++j) {
    const int64_t v = ids.data_ptr<int64_t>()[j];
    TORCH_CHECK(v >= 0 && v < z.V, "residual_argmax: q's token ", v, " outside the row");
    q.emplace_back(v, probs.data_ptr<double>()[j]);
  }
  std::stable_sort(q.begin(), q.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Overrides over;
  double overlap = 0.0;  // sum min(p, q)
  for (size_t j = 0; j < q.size(); ++j) {
    if (j && q[j].first == q[j - 1].first) {
      over.values.back() += q[j].second;
      continue;
    }
    over.ids.push_back(q[j].first);
    over.values.push_back(q[j].second);  // q until the probabilities are summed
  }
  for (size_t j = 0; j < over.ids.size(); ++j) {
    const double p = std::exp(z[over.ids[j]] - lse), q_v = over.values[j];
    overlap += std::min(p, q_v);
    over.values[j] = std::log(std::max(p - q_v, 0.0)) + lse;
  }
  if (1.0 - overlap <= 0) over = Overrides{};
  return gumbel_pick(z, seed, position, stream, offset, over);
}

// log sum_v exp(z_v) of a score row, fp64: the max m, then m + log(sum exp(z_v - m)). Terms below exp(-50) are left
// out: over up to 2^20 tokens they add under 2e-16 to a sum of at least 1 (its rounding). Long rows are summed in
// parts over the threads, the parts added in order: the same value at any thread count.
static double log_sum_exp(const ScoreRow& z) {
  const double m = z.max(0, z.V).first;
  if (!std::isfinite(m)) return m;
  auto sum = [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t v = begin; v < end; ++v) {
      const double d = z[v] - m;
      if (d >= -50.0) s += std::exp(d);
    }
    return s;
  };
  const int64_t parts = z.V >= 32768 ? std::max<int64_t>(at::get_num_threads(), 1) : 1;
  if (parts == 1) return m + std::log(sum(0, z.V));
  std::vector<double> sums(parts, 0.0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) sums[p] = sum(z.V * p / parts, z.V * (p + 1) / parts);
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return m + std::log(total);
}

double logsumexp_row(torch::Tensor row, double divisor, double floor) {
  return log_sum_exp(ScoreRow(row, divisor, floor));
}

// The smallest score top-k and top-p keep (distributions.warp, Hugging Face's semantics) over z = row / divisor,
// without sorting the row: top_k (0: off) keeps the scores at least the k-th largest (a heap of k); top_p (1: off) then
// keeps a score where the tokens above it hold less than top_p of p over what top-k kept. The scores within `span` of
// the best are sorted, the span doubling until they decide; a token tied with the last one kept is kept too (torch's
// sort leaves the order of ties unspecified). -inf where nothing is cut.
double warp_floor(torch::Tensor row, double divisor, int64_t top_k, double top_p) {
  ScoreRow z(row, divisor);
  if (top_k > 0 && top_k < z.V) {
    std::vector<double> heap;  // the k largest so far, smallest first
    heap.reserve(top_k);
    for (int64_t v = 0; v < z.V; ++v) {
      const double x = z[v];
      if (int64_t(heap.size()) < top_k) {
        heap.push_back(x);
        std::push_heap(heap.begin(), heap.end(), std::greater<double>());
      } else if (x > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<double>());
        heap.back() = x;
        std::push_heap(heap.begin(), heap.end(), std::greater<double>());
      }
    }
    z.floor = heap.front();
  }
  if (!(top_p < 1.0)) return z.floor;
  const double m = z.max(0, z.V).first, lse = log_sum_exp(z);
  int64_t live = 0;
  for (int64_t v = 0; v < z.V; ++v) live += z[v] > -INFINITY;
  for (double span = 8.0;; span *= 2) {
    std::vector<double> near;
    for (int64_t v = 0; v < z.V; ++v)
      if (z[v] >= m - span) near.push_back(z[v]);
    std::sort(near.begin(), near.end(), std::greater<double>());
    double above = 0.0;  // p of the tokens above the current score
    for (size_t i = 0, j; i < near.size(); i = j) {
      if (!(above < top_p)) return near[i - 1];  // near[i] and below are cut
      for (j = i; j < near.size() && near[j] == near[i]; ++j) above += std::exp(near[j] - lse);
    }
    if (int64_t(near.size()) == live) return z.floor;  // every token is kept
  }
}

// distributions.gumbel_at for many rows at once: row n's noise at token ids[n, j] for (seeds[n], streams[n],
// positions[n]) -> [N, m] fp64, -log(-log(u)) of each token's uniform (drawn by its counter alone).
torch::Tensor gumbel_rows(torch::Tensor ids, const std::vector<uint64_t>& seeds, const std::vector<uint64_t>& streams,
                          const std::vector<uint64_t>& positions) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == torch::kLong && ids.is_contiguous(), "gumbel_rows: ids [N, m]");
  const int64_t N = ids.size(0), m = ids.size(1);
  TORCH_CHECK(int64_t(seeds.size()) == N && int64_t(streams.size()) == N && int64_t(positions.size()) == N,
              "gumbel_rows: one seed, stream and position per row");
  auto out = torch::empty({N, m}, torch::kDouble);
  const int64_t* id = ids.data_ptr<int64_t>();
  double* g = out.data_ptr<double>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < m; ++j)
      g[n * m + j] = -std::log(-std::log(philox_uniform(seeds[n], streams[n], positions[n], uint64_t(id[n * m + j]))));
  return out;
}
