// Shared C++ of the CPU kernels (see common/kernels/cpu_kernels.py): the packed small-batch linear
// (`linear_into`) and attention over a KV head (`attend_head`). Every extension source starts with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// Lowered to what the CPU has (AVX-512, AVX2, SSE) for arithmetic; compares and selects on it are not
// lowered well without AVX-512 (GCC goes element by element: an argmax or a silu many times slower on
// AVX2), so those use `vf` below, the CPU's own width.
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

template <typename V>
static inline V loadv(const float* p) { V v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline v16 load16(const float* p) { return loadv<v16>(p); }

// The weight comes packed in panels of 64 output features: panel[i][c] = w[64 p + c][i], so a panel
// streams through memory contiguously.
//
// RB vectors V (16 or 8 features each) x RN rows of x. Every output element is the sum over i = 0..I-1
// in order, one fused multiply-add per step, whatever the tile: a row's result does not depend on the others.
template <typename V, int RB, int RN>
static inline void tile(const float* xp, const float* panel, float* yp, int64_t I, int64_t O, int64_t o, int64_t n) {
  constexpr int W = sizeof(V) / sizeof(float);
  V acc[RB][RN];
  for (int r = 0; r < RB; ++r) for (int c = 0; c < RN; ++c) acc[r][c] = V{};
  for (int64_t i = 0; i < I; ++i) {
    V wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = loadv<V>(panel + i * 64 + W * r);
    for (int c = 0; c < RN; ++c) {
      const float xs = xp[(n + c) * I + i];
      for (int r = 0; r < RB; ++r) acc[r][c] += wv[r] * xs;
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < RN; ++c) __builtin_memcpy(yp + (n + c) * O + o + W * r, &acc[r][c], sizeof(V));
}

#if defined(__AVX512F__)
// From this many rows on (prefill chunks, batched verifies) the panel goes as two halves of 32 features x 9-12
// rows: 24 accumulators and 2 weight vectors fit the 32 registers, where 4 x 8 spills, so a prefill's projections run
// faster; below 16 rows no faster (the weights come from L3 there, and a half-panel tile reads each 256-byte row
// twice).
constexpr int64_t MANY_ROWS = 16;

template <int RN>
static inline void halves(const float* xp, const float* pp, float* yp, int64_t I, int64_t O, int64_t o, int64_t n) {
  tile<v16, 2, RN>(xp, pp, yp, I, O, o, n);
  tile<v16, 2, RN>(xp, pp + 32, yp, I, O, o + 32, n);
}

// Rows [0, N) in groups of 8-12, as even as they come (16 -> 8 + 8, 50 -> 5 x 10); a group of 8 takes the
// whole-panel tile.
static void many_rows(const float* xp, const float* pp, float* yp, int64_t N, int64_t I, int64_t O, int64_t o) {
  const int64_t groups = (N + 11) / 12;
  for (int64_t g = 0, n = 0; g < groups; ++g) {
    const int64_t rows = (N - n) / (groups - g);
    switch (rows) {
      case 12: halves<12>(xp, pp, yp, I, O, o, n); break;
      case 11: halves<11>(xp, pp, yp, I, O, o, n); break;
      case 10: halves<10>(xp, pp, yp, I, O, o, n); break;
      case 9: halves<9>(xp, pp, yp, I, O, o, n); break;
      default: tile<v16, 4, 8>(xp, pp, yp, I, O, o, n); break;
    }
    n += rows;
  }
}

// One panel, whole (4 blocks of 16 features) for up to 8 rows at a time: the panel streams through once
// per 8 rows, contiguously (half-panel tiles read every 256-byte row in two strided passes, slower at
// 6-16 rows when the weights come from L3). 8 rows use 32 accumulators (some spill).
static void panel(const float* xp, const float* pp, float* yp, int64_t N, int64_t I, int64_t O, int64_t o) {
  if (N >= MANY_ROWS) { many_rows(xp, pp, yp, N, I, O, o); return; }
  int64_t n = 0;
  for (; N - n >= 8; n += 8) tile<v16, 4, 8>(xp, pp, yp, I, O, o, n);
  switch (N - n) {
    case 1: tile<v16, 4, 1>(xp, pp, yp, I, O, o, n); break;
    case 2: tile<v16, 4, 2>(xp, pp, yp, I, O, o, n); break;
    case 3: tile<v16, 4, 3>(xp, pp, yp, I, O, o, n); break;
    case 4: tile<v16, 4, 4>(xp, pp, yp, I, O, o, n); break;
    case 5: tile<v16, 4, 5>(xp, pp, yp, I, O, o, n); break;
    case 6: tile<v16, 4, 6>(xp, pp, yp, I, O, o, n); break;
    case 7: tile<v16, 4, 7>(xp, pp, yp, I, O, o, n); break;
    default: break;
  }
}

#else
// Without AVX-512 (AVX2: 16 vector registers of 8 floats) the tiles above spill most of their
// accumulators (8 rows x 64 features ran far slower than MKL). Here a tile is RB vectors of 8 features
// (a slice of the panel) x RN rows, so that its accumulators stay in the 16 registers.
static void panel(const float* xp, const float* pp, float* yp, int64_t N, int64_t I, int64_t O, int64_t o) {
  constexpr int RB = 4, RN = 3;  // of the shapes tried (4 x 3, 2 x 6, 4 x 2, 8 x 1), the fastest at 8 rows
  for (int64_t s = 0; s < 64; s += 8 * RB) {
    int64_t n = 0;
    for (; N - n >= RN; n += RN) tile<v8, RB, RN>(xp, pp + s, yp, I, O, o + s, n);
    if (N - n == 2) tile<v8, RB, 2>(xp, pp + s, yp, I, O, o + s, n);
    else if (N - n == 1) tile<v8, RB, 1>(xp, pp + s, yp, I, O, o + s, n);
  }
}
#endif

// y[n, o] = sum_i x[n, i] * w[o, i] for n < N; x [N, I] fp32 rows, packed [O / 64, I, 64] (see above), y [N, O].
static void linear_into(const float* xp, int64_t N, int64_t I, const torch::Tensor& packed, float* yp) {
  const int64_t P = packed.size(0), O = P * 64;
  TORCH_CHECK(packed.size(1) == I && packed.size(2) == 64, "small_linear: weight not packed for this input");
  const float* wp = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel(xp, wp + p * I * 64, yp, N, I, O, p * 64);
  });
}

// exp(x) for a vector of x <= 0 (scores less their maximum): x = k ln 2 + r with |r| <= ln 2 / 2, e^r
// from its degree-7 Taylor polynomial (relative error below 3e-7 on that range), times 2^k put into the
// exponent bits. Below -87 (e^x under fp32's normal range) the result is taken as 0. V: a float vector,
// VI: the int32 vector of its width.
template <typename V, typename VI>
static inline V exp_neg(V x) {
  const V floor = V{} - 87.f;
  const V xc = x < floor ? floor : x;  // keeps the int conversion below in range (-inf included)
  const V k = xc * 1.44269504088896341f;
  VI ki = __builtin_convertvector(k - 0.5f, VI);  // round to nearest (k <= 0: truncation moves up)
  const V kf = __builtin_convertvector(ki, V);
  const V r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;  // ln 2 split in two: r exact to fp32
  V p = r * (1.f / 5040.f) + 1.f / 720.f;
  p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f; p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  VI scale = (ki + 127) << 23;
  V two_k;
  __builtin_memcpy(&two_k, &scale, sizeof two_k);
  return x < floor ? V{} : p * two_k;
}

static inline float hsum8(v8 a) {  // halves added pairwise: a fixed order
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hsum16(v16 v) {
  return hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

static inline float dot16(const float* a, const float* b, int64_t n) {  // n % 16 == 0
  v16 acc = v16{};
  for (int64_t i = 0; i < n; i += 16) acc += load16(a + i) * load16(b + i);
  return hsum16(acc);
}

// y = w * x / sqrt(mean(x^2) + eps), row by row (D % 16 == 0); y may be x.
static void rms_rows(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    const float inv = 1.0f / std::sqrt(dot16(xr, xr, D) / D + eps);
    float* yr = y + n * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = w[d] * (xr[d] * inv);
  }
}

// In place: head vector h [hd] normed by w (none: not normed), then rotated (rotate-half layout) at the table row.
static void norm_rope(float* h, const float* w, const float* cos, const float* sin, int64_t hd, float eps) {
  if (w) rms_rows(h, w, h, 1, hd, eps);
  const int64_t half = hd / 2;
  float tmp[1024];
  for (int64_t i = 0; i < hd; ++i) tmp[i] = h[i];
  for (int64_t i = 0; i < hd; ++i) h[i] = tmp[i] * cos[i] + (i < half ? -tmp[i + half] : tmp[i - half]) * sin[i];
}

// The attention's vector: the CPU's own width (GCC splits a wider vector into several registers, and its
// loops over arrays of them then spill: 16-float vectors ran several times slower on an AVX2 machine).
#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vif __attribute__((vector_size(VW * 4)));

#if defined(__AVX512F__)
static inline float hsumf(vf v) { return hsum16(v); }
#else
static inline float hsumf(vf v) { return hsum8(v); }
#endif

// Attention of nq queries sharing one KV head: q(i) the vector of query i, key(j) / value(j) the rows of
// key j (hd = BLK vectors of VW floats each), query i seeing keys 0..n[i] - 1, out(i) where its result goes.
// Scores, then each query's softmax, then the weighted values, in chunks of queries that read each key
// or value row once for the chunk. The arithmetic of a query (its dot products, softmax and weighted
// sum, in key order) is the same whatever the others: a row's result does not depend on its batch.
// scores: nq x row floats of scratch, row >= max n + 16.
template <int BLK, typename Query, typename Key, typename Value, typename Out>
static void attend_head(Query q, Key key, Value value, Out out, const int64_t* n, int64_t nq, float* scores,
                        int64_t row, float scale) {
  constexpr int QC = BLK >= VW ? 1 : VW / BLK;  // queries per chunk: QC x BLK accumulators fit the registers
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {  // scores: 4 queries at a time
    const int64_t count = std::min<int64_t>(4, nq - i0);
    int64_t reach = 0;
    for (int64_t i = i0; i < i0 + count; ++i) reach = std::max(reach, n[i]);
    const float* qs[4];
    for (int64_t i = 0; i < 4; ++i) qs[i] = q(i0 + std::min(i, count - 1));
    for (int64_t j = 0; j < reach; ++j) {  // past a query's own n: computed, never read
      const float* k = key(j);
      vf acc[4] = {vf{}, vf{}, vf{}, vf{}};
      for (int c = 0; c < BLK; ++c) {
        const vf kv = loadv<vf>(k + VW * c);
        for (int i = 0; i < 4; ++i) acc[i] += loadv<vf>(qs[i] + VW * c) * kv;
      }
      for (int64_t i = 0; i < count; ++i) scores[(i0 + i) * row + j] = hsumf(acc[i]) * scale;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {  // softmax numerators in place, each query's own
    float* s = scores + i * row;
    float m = s[0];
    for (int64_t j = 1; j < n[i]; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = n[i]; j < (n[i] + VW - 1) / VW * VW; ++j) s[j] = -INFINITY;
    vf total = vf{};
    for (int64_t j = 0; j < n[i]; j += VW) {
      const vf e = exp_neg<vf, vif>(loadv<vf>(s + j) - m);
      __builtin_memcpy(s + j, &e, sizeof e);
      total += e;
    }
    s[row - 1] = 1.f / hsumf(total);  // past every key: the normaliser
  }
  for (int64_t i0 = 0; i0 < nq; i0 += QC) {  // weighted values
    const int64_t count = std::min<int64_t>(QC, nq - i0);
    int64_t reach = 0;
    for (int64_t i = i0; i < i0 + count; ++i) reach = std::max(reach, n[i]);
    vf acc[QC][BLK];
    for (int i = 0; i < QC; ++i) for (int c = 0; c < BLK; ++c) acc[i][c] = vf{};
    for (int64_t j = 0; j < reach; ++j) {
      const float* v = value(j);
      for (int i = 0; i < QC; ++i) {
        if (i >= count || j >= n[i0 + i]) continue;
        const float w = scores[(i0 + i) * row + j];
        for (int c = 0; c < BLK; ++c) acc[i][c] += loadv<vf>(v + VW * c) * w;
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const float inv = scores[(i0 + i) * row + row - 1];
      float* o = out(i0 + i);
      for (int c = 0; c < BLK; ++c) {
        const vf y = acc[i][c] * inv;
        __builtin_memcpy(o + VW * c, &y, sizeof y);
      }
    }
  }
}

// attend_head for a head size known at run time: 16, 32, 64, 128 or 256.
template <typename... A>
static void attend_head_hd(int64_t hd, A&&... a) {
  switch (hd) {
    case 16: attend_head<16 / VW>(a...); break;
    case 32: attend_head<32 / VW>(a...); break;
    case 64: attend_head<64 / VW>(a...); break;
    case 128: attend_head<128 / VW>(a...); break;
    default: TORCH_CHECK(hd == 256, "attention: head size ", hd, " unsupported"); attend_head<256 / VW>(a...);
  }
}

static constexpr int64_t ATTEND_CHUNK = 16;  // queries per parallel task (a KV head's queries split in such chunks)

// The sampling noise of common/runtime/distributions.py (`uniforms`): uniform `index` of numpy's Philox4x64-10 keyed
// (seed, stream) with the counter at (0, 0, position). numpy advances the counter's first word before each block of 4
// outputs, so uniform i is word i % 4 of the block at counter (i / 4 + 1, 0, position): any token's noise is drawn
// without the ones before it. Doubles as numpy makes them (the top 53 bits), at least the smallest normal double.
static inline uint64_t mulhilo(uint64_t a, uint64_t b, uint64_t* hi) {
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  *hi = uint64_t(product >> 64);
  return uint64_t(product);
}

// One block of 4 outputs: the counter (block + 1, 0, position).
static inline void philox_block(uint64_t seed, uint64_t stream, uint64_t position, uint64_t block, uint64_t* c) {
  c[0] = block + 1; c[1] = 0; c[2] = position; c[3] = 0;
  uint64_t k0 = seed, k1 = stream;
  for (int round = 0; round < 10; ++round) {
    uint64_t hi0, hi1;
    const uint64_t lo0 = mulhilo(0xD2E7470EE14C6C93ULL, c[0], &hi0), lo1 = mulhilo(0xCA5A826395121157ULL, c[2], &hi1);
    c[0] = hi1 ^ c[1] ^ k0; c[1] = lo1; c[2] = hi0 ^ c[3] ^ k1; c[3] = lo0;
    k0 += 0x9E3779B97F4A7C15ULL;
    k1 += 0xBB67AE8584CAA73BULL;
  }
}

static inline double philox_double(uint64_t word) {
  return std::max(double(word >> 11) * (1.0 / 9007199254740992.0), 2.2250738585072014e-308);
}

static double philox_uniform(uint64_t seed, uint64_t stream, uint64_t position, uint64_t index) {
  uint64_t c[4];
  philox_block(seed, stream, position, index / 4, c);
  return philox_double(c[index % 4]);
}
