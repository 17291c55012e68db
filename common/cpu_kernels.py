"""A small-batch linear layer for the CPU: y = x @ w.T for up to 256 rows, reading each weight once.

Decoding is a matrix-vector product per layer, a verify step a product with k + 1 rows. On the 2-core
VM this project is measured on, MKL's fp32 product over the default target's 17 MB of weights takes
1.55 ms with one row and 1.9 ms with six, where a plain read of the same bytes takes 0.37 ms. The
kernel below takes 0.49 ms / 1.2 ms (`tests/common/test_cpu_kernels.py` checks its results). It stays
ahead of MKL up to 256 rows on the default target's shapes (a batched verify at concurrency 16 has
96-128): 190-220 GFLOP/s against MKL's 90-190 (256 x 4096 LM head: 2.6 ms against 3.9).

* Layout: each weight is copied once, packed in panels of 64 output features ([O / 64, I, 64]), so
  the kernel streams a panel contiguously and computes it for every row of x while it sits in cache.
* Determinism: every output element is the sum over the input features in order, one fused
  multiply-add per step, whatever the row count and the thread split. A row's result does not depend
  on the batch it sits in (a 1-token decode and a (k+1)-token verify agree bitwise on these layers),
  and fused projections (q, k, v together) give exactly what each projection gives alone.
* Scope: fp32 CPU inference on a module's own parameters, at most MAX_ROWS rows, output features a
  multiple of 64. Anything else (training, prefill chunks over 256 tokens, GPU, bf16, a tensor shared from another process)
  goes to torch's linear. The packed copies count against a per-process budget
  ($BLOCKSPEC_CPU_KERNELS_MAX_MB, 1024 MiB): a model too big to hold twice keeps torch's linear.
* Also here: `cached_attention`, attention of decode and verify steps (at most ATTENTION_MAX_QUERIES
  queries per row) over the slot KV cache read in place, where SDPA needs the keys gathered and a mask
  built, and its CPU flash kernel calls MKL with tiny shapes (about 50 us a layer at 8 queries); and
  `argmax_rows`, the row argmax of a verify's logits.
* Switch: BLOCKSPEC_CPU_KERNELS=0 (or `set_enabled(False)`) turns the kernel off.
* Build: compiled on first use by torch's C++ extension loader (g++ and ninja, about 35 s here, then
  cached under ~/.cache/torch_extensions). Where it cannot be built, torch's linear is used and the
  log says so once.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MAX_ROWS = 256  # above this (prefill chunks), torch's linear: not measured to lose, not measured to win
ATTENTION_MAX_QUERIES = 64  # cached_attention up to this many queries per row (more: SDPA, blocked for them)
ENV_SWITCH = "BLOCKSPEC_CPU_KERNELS"  # "0" turns the kernel off (torch's linear everywhere)
ENV_BUDGET = "BLOCKSPEC_CPU_KERNELS_MAX_MB"  # packed copies per process, MiB (default 1024)

PANEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

typedef float v16 __attribute__((vector_size(64)));  // lowered to what the CPU has (AVX-512, AVX2, SSE)

static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }

// The weight comes packed in panels of 64 output features: panel[i][c] = w[64 p + c][i], so a panel
// streams through memory contiguously.
//
// RB blocks of 16 features x RN rows of x. Every output element is the sum over i = 0..I-1 in order,
// one fused multiply-add per step, whatever the tile: a row's result does not depend on the others.
template <int RB, int RN>
static inline void tile(const float* xp, const float* panel, float* yp, int64_t I, int64_t O, int64_t o, int64_t n) {
  v16 acc[RB][RN];
  for (int r = 0; r < RB; ++r) for (int c = 0; c < RN; ++c) acc[r][c] = v16{};
  for (int64_t i = 0; i < I; ++i) {
    v16 wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = load16(panel + i * 64 + 16 * r);
    for (int c = 0; c < RN; ++c) {
      const float xs = xp[(n + c) * I + i];
      for (int r = 0; r < RB; ++r) acc[r][c] += wv[r] * xs;
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < RN; ++c) __builtin_memcpy(yp + (n + c) * O + o + 16 * r, &acc[r][c], sizeof(v16));
}

// One panel, whole (4 blocks of 16 features) for up to 8 rows at a time: the panel streams through once
// per 8 rows, contiguously (half-panel tiles read every 256-byte row in two strided passes and ran
// 15-40% slower at 6-16 rows when the weights come from L3). 8 rows use 32 accumulators (some spill).
static void panel(const float* xp, const float* pp, float* yp, int64_t N, int64_t I, int64_t O, int64_t o) {
  int64_t n = 0;
  for (; N - n >= 8; n += 8) tile<4, 8>(xp, pp, yp, I, O, o, n);
  switch (N - n) {
    case 1: tile<4, 1>(xp, pp, yp, I, O, o, n); break;
    case 2: tile<4, 2>(xp, pp, yp, I, O, o, n); break;
    case 3: tile<4, 3>(xp, pp, yp, I, O, o, n); break;
    case 4: tile<4, 4>(xp, pp, yp, I, O, o, n); break;
    case 5: tile<4, 5>(xp, pp, yp, I, O, o, n); break;
    case 6: tile<4, 6>(xp, pp, yp, I, O, o, n); break;
    case 7: tile<4, 7>(xp, pp, yp, I, O, o, n); break;
    default: break;
  }
}

// y[n, o] = sum_i x[n, i] * w[o, i] for n < N; x [N, I] fp32 rows, packed [O / 64, I, 64] (see above), y [N, O].
static void linear_into(const float* xp, int64_t N, int64_t I, const torch::Tensor& packed, float* yp) {
  const int64_t P = packed.size(0), O = P * 64;
  TORCH_CHECK(packed.size(1) == I && packed.size(2) == 64, "small_linear: weight not packed for this input");
  const float* wp = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel(xp, wp + p * I * 64, yp, N, I, O, p * 64);
  });
}

typedef int32_t vi16 __attribute__((vector_size(64)));

// exp(x) for a vector of x <= 0 (scores less their maximum): x = k ln 2 + r with |r| <= ln 2 / 2, e^r
// from its degree-7 Taylor polynomial (relative error below 3e-7 on that range), times 2^k put into the
// exponent bits. Below -87 (e^x under fp32's normal range) the result is taken as 0.
static inline v16 exp16(v16 x) {
  const v16 floor = v16{} - 87.f;
  const v16 xc = x < floor ? floor : x;  // keeps the int conversion below in range (-inf included)
  const v16 k = xc * 1.44269504088896341f;
  vi16 ki = __builtin_convertvector(k - 0.5f, vi16);  // round to nearest (k <= 0: truncation moves up)
  const v16 kf = __builtin_convertvector(ki, v16);
  const v16 r = (xc - kf * 0.693359375f) - kf * -2.12194440e-4f;  // ln 2 split in two: r exact to fp32
  v16 p = r * (1.f / 5040.f) + 1.f / 720.f;
  p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f; p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  vi16 scale = (ki + 127) << 23;
  v16 two_k;
  __builtin_memcpy(&two_k, &scale, sizeof two_k);
  return x < floor ? v16{} : p * two_k;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum16(v16 v) {  // halves added pairwise: a fixed order
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot16(const float* a, const float* b, int64_t n) {  // n % 16 == 0
  v16 acc = v16{};
  for (int64_t i = 0; i < n; i += 16) acc += load16(a + i) * load16(b + i);
  return hsum16(acc);
}

// Attention of nq queries sharing one KV head: q(i) the vector of query i, key(j) / value(j) the rows of
// key j (hd = 16 BLK floats each), query i seeing keys 0..n[i] - 1, out(i) where its result goes.
// Scores, then each query's softmax, then the weighted values, in chunks of queries that read each key
// or value row once for the chunk. The arithmetic of a query (its dot products, softmax and weighted
// sum, in key order) is the same whatever the others: a row's result does not depend on its batch.
// scores: nq x row floats of scratch, row >= max n + 16.
template <int BLK, typename Query, typename Key, typename Value, typename Out>
static void attend_head(Query q, Key key, Value value, Out out, const int64_t* n, int64_t nq, float* scores,
                        int64_t row, float scale) {
  constexpr int QC = BLK >= 16 ? 1 : 16 / BLK;  // queries per chunk: QC x BLK accumulators fit the registers
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {  // scores: 4 queries at a time
    const int64_t count = std::min<int64_t>(4, nq - i0);
    int64_t reach = 0;
    for (int64_t i = i0; i < i0 + count; ++i) reach = std::max(reach, n[i]);
    const float* qs[4];
    for (int64_t i = 0; i < 4; ++i) qs[i] = q(i0 + std::min(i, count - 1));
    for (int64_t j = 0; j < reach; ++j) {  // past a query's own n: computed, never read
      const float* k = key(j);
      v16 acc[4] = {v16{}, v16{}, v16{}, v16{}};
      for (int c = 0; c < BLK; ++c) {
        const v16 kv = load16(k + 16 * c);
        for (int i = 0; i < 4; ++i) acc[i] += load16(qs[i] + 16 * c) * kv;
      }
      for (int64_t i = 0; i < count; ++i) scores[(i0 + i) * row + j] = hsum16(acc[i]) * scale;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {  // softmax numerators in place, each query's own
    float* s = scores + i * row;
    float m = s[0];
    for (int64_t j = 1; j < n[i]; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = n[i]; j < (n[i] + 15) / 16 * 16; ++j) s[j] = -INFINITY;
    v16 total = v16{};
    for (int64_t j = 0; j < n[i]; j += 16) {
      const v16 e = exp16(load16(s + j) - m);
      __builtin_memcpy(s + j, &e, sizeof e);
      total += e;
    }
    s[row - 1] = 1.f / hsum16(total);  // past every key: the normaliser
  }
  for (int64_t i0 = 0; i0 < nq; i0 += QC) {  // weighted values
    const int64_t count = std::min<int64_t>(QC, nq - i0);
    int64_t reach = 0;
    for (int64_t i = i0; i < i0 + count; ++i) reach = std::max(reach, n[i]);
    v16 acc[QC][BLK];
    for (int i = 0; i < QC; ++i) for (int c = 0; c < BLK; ++c) acc[i][c] = v16{};
    for (int64_t j = 0; j < reach; ++j) {
      const float* v = value(j);
      for (int i = 0; i < QC; ++i) {
        if (i >= count || j >= n[i0 + i]) continue;
        const float w = scores[(i0 + i) * row + j];
        for (int c = 0; c < BLK; ++c) acc[i][c] += load16(v + 16 * c) * w;
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const float inv = scores[(i0 + i) * row + row - 1];
      float* o = out(i0 + i);
      for (int c = 0; c < BLK; ++c) {
        const v16 y = acc[i][c] * inv;
        __builtin_memcpy(o + 16 * c, &y, sizeof y);
      }
    }
  }
}

// attend_head for a head size known at run time: 16, 32, 64, 128 or 256.
template <typename... A>
static void attend_head_hd(int64_t hd, A&&... a) {
  switch (hd) {
    case 16: attend_head<1>(a...); break;
    case 32: attend_head<2>(a...); break;
    case 64: attend_head<4>(a...); break;
    case 128: attend_head<8>(a...); break;
    default: TORCH_CHECK(hd == 256, "attention: head size ", hd, " unsupported"); attend_head<16>(a...);
  }
}

static constexpr int64_t ATTEND_CHUNK = 16;  // queries per parallel task (a KV head's queries split in such chunks)
"""

_SOURCE = PANEL_SOURCE + r"""
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed) {
  auto y = torch::empty({x.size(0), packed.size(0) * 64}, x.options());
  linear_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

// The index of each row's largest value (the first among equals; a NaN counts as the largest, as in
// torch.argmax); x [N, V] contiguous fp32. One vector pass finds the maximum and whether the row has a
// NaN, a second the first index holding it.
std::vector<int64_t> argmax_rows(torch::Tensor x) {
  const int64_t N = x.size(0), V = x.size(1), whole = V / 16 * 16;
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> out(N);
  for (int64_t n = 0; n < N; ++n) {
    const float* row = xp + n * V;
    float value = row[0];
    bool nan = false;
    if (whole) {
      v16 mx = load16(row);
      vi16 bad = mx != mx;
      for (int64_t v = 16; v < whole; v += 16) {
        const v16 a = load16(row + v);
        bad |= a != a;
        mx = a > mx ? a : mx;
      }
      for (int i = 0; i < 16; ++i) { nan |= bad[i] != 0; value = mx[i] > value ? mx[i] : value; }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear);
  m.def("argmax_rows", &argmax_rows);
  m.def("cached_attention", &cached_attention);
}
"""

_lock = threading.Lock()
_state = {"switch": os.environ.get(ENV_SWITCH, "1") != "0"}
_packs: dict[tuple[int, ...], tuple] = {}  # ids of weights -> (weakrefs, versions, packed copy)
_budget = {"left": int(os.environ.get(ENV_BUDGET, "1024")) * 2**20}  # bytes of packed copies still allowed


class Extension:
    """A C++ extension built with this module's flags on first use (or loaded from torch's cache).
    `get()` is None while the kernels are switched off, or for good, logged once with what is used
    instead (`fallback`), where it cannot be built. Sources start from PANEL_SOURCE to use `linear_into`."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self.module, self.failed = None, False

    def get(self):
        if not _state["switch"]:
            return None
        if self.module is None and not self.failed:
            with _lock:
                if self.module is None and not self.failed:
                    self.module = self._build()
                    self.failed = self.module is None
        return self.module

    def _build(self):
        try:
            from torch.utils.cpp_extension import load_inline

            return load_inline(self.name, cpp_sources=self.source, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
            log.warning("CPU kernel %s unavailable, using %s: %s", self.name, self.fallback, exc)
            return None


_kernels = Extension("blockspec_cpu_kernels", _SOURCE, "torch's linear")


def set_enabled(on: bool) -> None:
    """Turn the kernels on or off for this process (the default comes from $BLOCKSPEC_CPU_KERNELS)."""
    _state["switch"] = on


def enabled() -> bool:
    return _kernels.get() is not None


def packed(weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """cat(weights) [O, I] packed as [O / 64, I, 64] for the kernel: a copy, made once per set of weights
    (again if one is modified in place). None once the process's budget of copies is spent: a model too
    big to hold twice keeps torch's linear."""
    key = tuple(id(w) for w in weights)
    entry = _packs.get(key)
    if (entry is None or any(ref() is not w for ref, w in zip(entry[0], weights))
            or entry[1] != tuple(w._version for w in weights)):
        size = sum(w.numel() * w.element_size() for w in weights)
        with _lock:
            if entry is not None:
                _budget["left"] += entry[2].numel() * entry[2].element_size()
            if size > _budget["left"]:
                _packs.pop(key, None)
                return None
            _budget["left"] -= size

        def drop(_, key=key, size=size) -> None:
            if _packs.pop(key, None) is not None:
                _budget["left"] += size

        entry = (tuple(weakref.ref(w, drop) for w in weights), tuple(w._version for w in weights),
                 _pack(torch.cat([w.detach() for w in weights])))
        _packs[key] = entry
    return entry[2]


def _pack(w: torch.Tensor) -> torch.Tensor:
    out_features, in_features = w.shape
    return w.reshape(out_features // 64, 64, in_features).transpose(1, 2).contiguous()


def _applies(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> int:
    """The row count of x when the kernel applies to it and these weights, else 0."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or not enabled():
        return 0
    for w in weights:
        # Only a module's own parameters: a tensor mapped from another process (the target's LM head in
        # a remote drafter) is never copied.
        if (not isinstance(w, nn.Parameter) or w.dtype != torch.float32 or w.shape[0] % 64
                or (w.requires_grad and torch.is_grad_enabled())):
            return 0
    return rows


def _kernel_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """x @ cat(weights).T (+ the biases) through the kernel; None where it does not apply."""
    panels = packed(weights) if (rows := _applies(x, weights)) else None
    if panels is None:
        return None
    y = _kernels.module.small_linear(x.reshape(rows, x.shape[-1]).contiguous(), panels)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if all(b is None for b in biases):
        return y
    return y + torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the small-batch kernel where it applies (CPU, fp32, inference, <= MAX_ROWS rows)."""
    y = _kernel_linear(x, (weight,), (bias,))
    return F.linear(x, weight, bias) if y is None else y


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """cat([layer(x) for layer in layers], -1) in one pass over their weights where the kernel applies.
    Every output element is computed exactly as the layer alone would compute it."""
    y = _kernel_linear(x, tuple(layer.weight for layer in layers), [layer.bias for layer in layers])
    return torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1) if y is None else y


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def attends_in_place(cache: torch.Tensor, queries: int) -> bool:
    """Whether `cached_attention` applies to a forward of `queries` tokens per row over this KV cache
    [layers, slots, kv_heads, max_len, head_dim]: CPU, fp32, head_dim 16, 32, 64, 128 or 256, at most
    ATTENTION_MAX_QUERIES (decode and verify steps; prefill chunks go to SDPA), inference (no autograd)."""
    return (cache.device.type == "cpu" and cache.dtype == torch.float32 and cache.shape[-1] in (16, 32, 64, 128, 256)
            and queries <= ATTENTION_MAX_QUERIES and not torch.is_grad_enabled() and enabled())


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal attention over one layer's cache, read in place: q [B, heads, T, hd], k_cache / v_cache
    [slots, kv_heads, max_len, hd], slots [B], positions [B, T] (query (b, t) sees keys 0..positions[b, t]
    of slot slots[b]; grouped heads share a KV head) -> [B, T, heads * hd], scale 1 / sqrt(hd). What SDPA
    with the causal mask computes, within fp32 rounding (a degree-7 exp; every query on its own, so a
    row's result does not depend on its batch). Call where `attends_in_place` holds."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    return _kernels.module.cached_attention(q, k_cache, v_cache, slots, positions, q.shape[-1] ** -0.5)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """x.argmax(-1).tolist() for x [N, V]: one C++ loop for fp32 on the CPU (30 -> a few us for a verify's
    8 x 4096 logits), the same indices (first among equals, NaN as the largest)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] and enabled():
        return _kernels.module.argmax_rows(x.contiguous())
    return x.argmax(dim=-1).tolist()
