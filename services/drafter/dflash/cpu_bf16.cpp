// The drafter's bf16 and int8 projections on the CPU (see cpu_block.py): vector kernels and AMX tiles. Compiled
// after common/kernels/cpu_shared.cpp and before cpu_block.cpp, which calls linear_bf16_into and linear_i8_into and exports
// them, set_amx, amx_on and int8_supported.
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// bf16 weights (the drafter's option, see cpu_block.py): panels [O / 64, I / 2, 64, 2] with
// panel[j][c][t] = w[64 p + c][2 j + t], so one 512-bit load holds two inputs of 16 features and
// `vdpbf16ps` adds both products into fp32. x is rounded to bf16 (to nearest even, as torch rounds) and
// every sum is fp32, in input order. Where the compiler targets AVX512-BF16, or else AVX2 with FMA
// (`bf16_supported`), which has no bf16 product: there a weight widens to fp32 exactly (a bf16 is the
// top half of an fp32) and each product, exact in fp32, is added with an FMA.
typedef uint32_t vu8 __attribute__((vector_size(32)));  // 8 fp32 bit patterns (the AVX2 path)

// fp32 bit patterns (a uint32_t or a vu8) rounded to the nearest bf16, ties to even, kept as fp32 bits.
template <typename U>
static inline U bf16_rounded(U u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u; }

static inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return bf16_rounded(u) >> 16;
}

#if defined(__AVX512BF16__)
#define BF16_KERNEL 1
template <int RN>
static inline void tile_bf16(const uint32_t* xb, const uint16_t* panel, float* yp, int64_t J, int64_t O, int64_t o,
                             int64_t n) {
  __m512 acc[4][RN];
  for (int r = 0; r < 4; ++r) for (int c = 0; c < RN; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    __m512bh wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(panel + j * 128 + 32 * r);
    for (int c = 0; c < RN; ++c) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xb[(n + c) * J + j]));
      for (int r = 0; r < 4; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[r], xv);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < RN; ++c) _mm512_storeu_ps(yp + (n + c) * O + o + 16 * r, acc[r][c]);
}

// Up to 7 rows in one tile; more in tiles of 4 rows until 4-7 are left. 8-row tiles (32 accumulators,
// which spill) ran slower from 8 to 48 rows, unlike the fp32 kernel's.
static void panel_bf16(const uint32_t* xb, const uint16_t* pp, float* yp, int64_t N, int64_t J, int64_t O, int64_t o) {
  int64_t n = 0;
  for (; N - n >= 8; n += 4) tile_bf16<4>(xb, pp, yp, J, O, o, n);
  switch (N - n) {
    case 1: tile_bf16<1>(xb, pp, yp, J, O, o, n); break;
    case 2: tile_bf16<2>(xb, pp, yp, J, O, o, n); break;
    case 3: tile_bf16<3>(xb, pp, yp, J, O, o, n); break;
    case 4: tile_bf16<4>(xb, pp, yp, J, O, o, n); break;
    case 5: tile_bf16<5>(xb, pp, yp, J, O, o, n); break;
    case 6: tile_bf16<6>(xb, pp, yp, J, O, o, n); break;
    case 7: tile_bf16<7>(xb, pp, yp, J, O, o, n); break;
    default: break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_KERNEL 1

// RN rows x 32 features (4 vectors of 8): one 256-bit load holds both inputs of a pair for 8 features,
// the even input in each lane's low half. xr: x rounded to bf16, as fp32 [N, 2 J].
template <int RN>
static inline void tile_bf16(const float* xr, const uint16_t* panel, float* yp, int64_t J, int64_t O, int64_t o,
                             int64_t n) {
  v8 acc[4][RN];
  for (int r = 0; r < 4; ++r) for (int c = 0; c < RN; ++c) acc[r][c] = v8{};
  for (int64_t j = 0; j < J; ++j) {
    for (int r = 0; r < 4; ++r) {
      vu8 w;
      __builtin_memcpy(&w, panel + j * 128 + 16 * r, sizeof w);
      const vu8 even_bits = w << 16, odd_bits = w & 0xFFFF0000u;
      v8 even, odd;
      __builtin_memcpy(&even, &even_bits, sizeof even);
      __builtin_memcpy(&odd, &odd_bits, sizeof odd);
      for (int c = 0; c < RN; ++c) {
        const float* x = xr + (n + c) * 2 * J + 2 * j;
        acc[r][c] += even * x[0];
        acc[r][c] += odd * x[1];
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < RN; ++c) __builtin_memcpy(yp + (n + c) * O + o + 8 * r, &acc[r][c], sizeof(v8));
}

// Two halves of the panel, each in tiles of 2 rows: 8 accumulators (of the shapes tried at 12 rows -
// 4 x 3, 2 x 4, 4 x 2, 2 x 6, 1 x 6, 2 x 3 vectors x rows - the fastest, from cache and from memory).
static void panel_bf16(const float* xr, const uint16_t* pp, float* yp, int64_t N, int64_t J, int64_t O, int64_t o) {
  for (int64_t s = 0; s < 64; s += 32) {
    int64_t n = 0;
    for (; N - n >= 2; n += 2) tile_bf16<2>(xr, pp + 2 * s, yp, J, O, o + s, n);
    if (N - n == 1) tile_bf16<1>(xr, pp + 2 * s, yp, J, O, o + s, n);
  }
}
#else
#define BF16_KERNEL 0
#endif

static bool bf16_supported() { return BF16_KERNEL; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Intel AMX (Sapphire Rapids and later): TDPBF16PS multiplies a tile of 16 rows x 16 pairs of bf16 inputs by
// 16 pairs x 16 output features and adds the pairs' products into 16 x 16 fp32 sums, pair after pair in input
// order: the products of `vdpbf16ps` above, rounded in another order inside a pair (within a few ulp of it; 10-65%
// of the outputs bit for bit equal at 2048-64 inputs). Up to 16 rows of x go in one A tile (padded with zero
// rows); the B tile is 16 pairs of one panel's rows, 16 of its 64 features (a 64-byte slice of each 256-byte
// row). Inputs in whole tiles of 32 only (J % 16 == 0); others take the vector path.
static bool amx_ready() {  // Linux hands a process the tile state only when asked (once per process)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the sums (16 rows x 16 fp32), 4: x (16 rows x 16 pairs), 5 and 6: the weights (16 pairs x 16
// features). Loaded at every call: the configuration is the thread's, and other code (oneDNN) may change it.
static void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// y [N, O] (row stride O) from xs [N16, J] (bf16 pairs, N16 = N rounded up to 16, the extra rows zero) and P bf16
// panels; J % 16 == 0.
static void amx_panels(const uint32_t* xs, const uint16_t* wp, float* yp, int64_t N, int64_t J, int64_t P, int64_t O) {
  amx_configure();
  alignas(64) float out[16 * 64];
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    for (int64_t p = 0; p < P; ++p) {
      const uint16_t* panel = wp + p * J * 128;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t j = 0; j < J; j += 16) {
        _tile_loadd(4, xs + n0 * J + j, J * 4);
        const uint16_t* w = panel + j * 128;
        _tile_loadd(5, w, 256); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, w + 32, 256); _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, w + 64, 256); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, w + 96, 256); _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, out, 256); _tile_stored(1, out + 16, 256);
      _tile_stored(2, out + 32, 256); _tile_stored(3, out + 48, 256);
      for (int64_t n = 0; n < std::min<int64_t>(16, N - n0); ++n)
        std::memcpy(yp + (n0 + n) * O + p * 64, out + n * 64, 64 * sizeof(float));
    }
  }
  _tile_release();
}
#if defined(__AMX_INT8__)
// int8 weights (W8, `cpu_kernels.packed(..., "int8")`): panels [P, J4 + 1, 64, 4] int8, where row j < J4 holds
// round(w[64 p + c][4 j + t] / s[64 p + c]) at [j][c][t], s the feature's max |w| / 127, and row J4 holds the
// panel's 64 scales s as fp32. Each row of x goes in as two int8 rows against the same weights: hi = round(x / sx)
// and lo = round((x / sx - hi) * 256), sx its max |x| / 127, so x keeps about 16 bits (within sx / 512) and only the
// weights are 8-bit. TDPBSSD multiplies a tile of 16 rows x 16 quads of int8 inputs by 16 quads x 16 features
// into int32 sums (exact): the 8 hi rows and their 8 lo rows fill one A tile, so a weight tile read from memory
// (half a bf16 one's bytes per weight) serves both. y = sx * s * (sum_hi + sum_lo / 256). Inputs in whole
// tiles of 64 (J4 % 16 == 0).
static void amx_panels_i8(const int8_t* xs, const float* xscale, const int8_t* wp, float* yp, int64_t N, int64_t J4,
                          int64_t P, int64_t O) {
  amx_configure();
  alignas(64) int32_t out[16 * 64];
  for (int64_t p = 0; p < P; ++p) {
    const int8_t* panel = wp + p * (J4 + 1) * 256;
    for (int64_t n0 = 0; n0 < N; n0 += 8) {  // a panel's further rows read it from L1 / L2
      const int8_t* a = xs + n0 * 2 * J4 * 4;  // 16 rows: the hi of rows n0 .. n0 + 7, then their lo
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t j = 0; j < J4; j += 16) {
        _tile_loadd(4, a + j * 4, J4 * 4);
        const int8_t* w = panel + j * 256;
        _tile_loadd(5, w, 256); _tile_dpbssd(0, 4, 5);
        _tile_loadd(6, w + 64, 256); _tile_dpbssd(1, 4, 6);
        _tile_loadd(5, w + 128, 256); _tile_dpbssd(2, 4, 5);
        _tile_loadd(6, w + 192, 256); _tile_dpbssd(3, 4, 6);
      }
      _tile_stored(0, out, 256); _tile_stored(1, out + 16, 256);
      _tile_stored(2, out + 32, 256); _tile_stored(3, out + 48, 256);
      const float* ws = reinterpret_cast<const float*>(panel + J4 * 256);
      for (int64_t n = 0; n < std::min<int64_t>(8, N - n0); ++n) {
        float* y = yp + (n0 + n) * O + p * 64;
        const float sx = xscale[n0 + n];
        for (int64_t c = 0; c < 64; ++c)
          y[c] = sx * ws[c] * (float(out[n * 64 + c]) + float(out[(n + 8) * 64 + c]) * (1.0f / 256.0f));
      }
    }
  }
  _tile_release();
}

// x [N, I] -> the A rows of amx_panels_i8 (blocks of 16: 8 hi rows, their 8 lo rows; zero past N) and the scales.
static void quantize_rows_i8(const float* xp, int64_t N, int64_t I, int8_t* xs, float* xscale) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = xp + n * I;
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < I; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float mx = _mm512_reduce_max_ps(m), sx = mx > 0.0f ? mx / 127.0f : 1.0f;
    xscale[n] = sx;
    const __m512 inv = _mm512_set1_ps(1.0f / sx), k256 = _mm512_set1_ps(256.0f);
    int8_t* hi = xs + ((n / 8) * 16 + n % 8) * I;
    int8_t* lo = hi + 8 * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), inv);
      const __m512i h = _mm512_cvtps_epi32(v);  // to nearest
      const __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(h)), k256));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtsepi32_epi8(h));  // saturating
      const __m512i l127 = _mm512_min_epi32(l, _mm512_set1_epi32(127));  // (x / sx - hi) * 256 may round to 128
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtsepi32_epi8(l127));
    }
  }
}
#define AMX_INT8_KERNEL 1
#endif
#define AMX_KERNEL 1
static constexpr int64_t AMX_SPLIT_PANELS = 4;

// fn(begin, end) over the P panels of a tile projection: from AMX_SPLIT_PANELS panels on, each of two threads its
// own share. Right after a verify the weights come from L3, and two threads keep more loads in flight: a proposal
// is faster at concurrency 1 and at 16 requests, its LM head most of all. The threshold matters little (2 to 32
// panels read the same within the noise, for int8 too).
template <typename F>
static void amx_split(int64_t P, const F& fn) {
  const int64_t per_thread = at::get_num_threads() > 1 && P >= AMX_SPLIT_PANELS ? (P + 1) / 2 : P;
  at::parallel_for(0, P, per_thread, fn);
}
#else
#define AMX_KERNEL 0
#endif
#ifndef AMX_INT8_KERNEL
#define AMX_INT8_KERNEL 0
#endif

// Whether linear_bf16 runs on AMX tiles: off until `set_amx(true)` (cpu_block.py), which turns it on where the
// extension was compiled for AMX and the kernel grants the tile state; returns what holds now (`amx_on` too).
static std::atomic<bool> use_amx{false};
static bool set_amx(bool on) {
#if AMX_KERNEL
  use_amx = on && amx_ready();
#endif
  return use_amx;
}
static bool amx_on() { return use_amx; }

// y [N, O] = x [N, I] @ w.T for bf16 panels (above).
static void linear_bf16_into(const float* xp, int64_t N, int64_t I, const torch::Tensor& packed, float* yp) {
  const int64_t P = packed.size(0), J = packed.size(1), O = P * 64;
  TORCH_CHECK(bf16_supported(), "bf16 panels need a CPU with AVX512-BF16 or AVX2");
  TORCH_CHECK(J * 2 == I && packed.size(2) == 64 && packed.size(3) == 2, "bf16 weight not packed for this input");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
#if defined(__AVX512BF16__)
  std::vector<uint32_t> xs((N + 15) / 16 * 16 * J);  // pairs of bf16, the even input low (zero rows past N: AMX)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < J; ++j)
      xs[n * J + j] = bf16_bits(xp[n * I + 2 * j]) | (bf16_bits(xp[n * I + 2 * j + 1]) << 16);
#if AMX_KERNEL
  if (use_amx && J % 16 == 0) {  // tile products (cpu_block.py)
    amx_split(P, [&](int64_t begin, int64_t end) {
      amx_panels(xs.data(), wp + begin * J * 128, yp + begin * 64, N, J, end - begin, O);
    });
    return;
  }
#endif
#else
  std::vector<float> xs(N * I);  // bf16 values as fp32, 8 at a time (I % 16 == 0)
  for (int64_t i = 0; i < N * I; i += 8) {
    vu8 u;
    __builtin_memcpy(&u, xp + i, sizeof u);
    const vu8 bits = bf16_rounded(u);
    __builtin_memcpy(xs.data() + i, &bits, sizeof bits);
  }
#endif
#if BF16_KERNEL
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel_bf16(xs.data(), wp + p * J * 128, yp, N, J, O, p * 64);
  });
#endif
}

// Whether the int8 panels can run here: compiled for AMX-INT8 and granted the tile state (the AMX switch aside:
// a drafter chooses int8 weights only with it on, and its panels keep running if it is later turned off).
static bool int8_supported() {
#if AMX_INT8_KERNEL
  return amx_ready();
#else
  return false;
#endif
}

// y [N, O] = x [N, I] @ w.T for int8 panels (above), on AMX tiles only.
static void linear_i8_into(const float* xp, int64_t N, int64_t I, const torch::Tensor& packed, float* yp) {
  const int64_t P = packed.size(0), J4 = packed.size(1) - 1, O = P * 64;
  TORCH_CHECK(int8_supported(), "int8 panels need AMX-INT8 tiles");
  TORCH_CHECK(J4 * 4 == I && J4 % 16 == 0 && packed.size(2) == 64 && packed.size(3) == 4,
              "int8 weight not packed for this input");
#if AMX_INT8_KERNEL
  std::vector<int8_t> xs((N + 7) / 8 * 16 * I, 0);
  std::vector<float> xscale(N);
  quantize_rows_i8(xp, N, I, xs.data(), xscale.data());
  const int8_t* wp = packed.data_ptr<int8_t>();
  amx_split(P, [&](int64_t begin, int64_t end) {
    amx_panels_i8(xs.data(), xscale.data(), wp + begin * (J4 + 1) * 256, yp + begin * 64, N, J4, end - begin, O);
  });
#endif
}

torch::Tensor linear_i8(torch::Tensor x, torch::Tensor packed) {
  auto y = torch::empty({x.size(0), packed.size(0) * 64});
  linear_i8_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

// The bf16 product by itself (tests compare it with torch).
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed) {
  auto y = torch::empty({x.size(0), packed.size(0) * 64});
  linear_bf16_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

