"""The Triton kernels behind `gpu_kernels`' operators on CUDA, and their launchers: products (a GEMM with tiles and split
of K fixed by the weight's shape and the device, left as split partials that the next kernel adds; the experts' grouped
GEMM), attention over the cache with a fixed key split, per-row norms and rotary with the K/V stores (a Gated
DeltaNet's kernels: `triton_deltanet.py`). Triton is imported on first use: the CPU path never needs it. `TRITON_INTERPRET=1` runs them on CPU tensors (tests/common/runtime/test_cuda_runner.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

CHUNK = 256  # keys per attention split at least: positions [c * chunk, (c + 1) * chunk) are one partial softmax
MAX_SPLITS = 32  # key splits at most: longer caches take longer chunks (`attention_chunk`)
BLOCK_M = 64  # GEMM rows per tile, whatever the row count (a decode's 1 row is a padded tile)
ATTN_BLOCK_N = 64  # keys per attention tile

@functools.cache
def _products() -> SimpleNamespace:
    """The GEMM, the sum of its split partials, the experts' grouped GEMM."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x, w, out, M, N, K, stride_xm, stride_wn, stride_sm,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr):
        # out[split, m, n] = sum over this split's K range of x[m, k] * w[n, k], in fp32, BK at a time in order; stored
        # in out's type (the output itself where K is not split).
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k0 = ps * K_STEPS * BK
        for step in range(K_STEPS):
            k = k0 + step * BK + rk
            a = tl.load(x + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(w + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(out + ps * stride_sm + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def sum_splits(parts, out, size, S: tl.constexpr, BLOCK: tl.constexpr):
        # out = parts[0] + parts[1] + ... in that order, cast to out's type.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < size
        total = tl.load(parts + i, mask=live, other=0.0)
        for s in range(1, S):
            total += tl.load(parts + s * size + i, mask=live, other=0.0)
        tl.store(out + i, total.to(out.dtype.element_ty), mask=live)

    @triton.jit
    def grouped_gemm(x, w, rows, block_expert, out, N, K, E, rows_per_x, stride_we, stride_wn,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr):
        # One block of BM rows of one expert (rows: the x row of each, -1 for padding), BN outputs:
        # out[r, n] = sum_k x[rows[r] // rows_per_x, k] * w[expert, n, k], BK at a time in order.
        pb, pn = tl.program_id(0), tl.program_id(1)
        e = tl.load(block_expert + pb)
        r = pb * BM + tl.arange(0, BM)
        src = tl.load(rows + r)
        live_r = (src >= 0) & (e < E)
        src_row = tl.where(src >= 0, src // rows_per_x, 0)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        we = w + tl.minimum(e, E - 1).to(tl.int64) * stride_we
        for step in range(K_STEPS):
            k = step * BK + rk
            a = tl.load(x + src_row[:, None] * K + k[None, :], mask=live_r[:, None] & (k[None, :] < K), other=0.0)
            b = tl.load(we + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K) & (e < E),
                        other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(out + r[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=(rn[None, :] < N))

    return SimpleNamespace(triton=triton, gemm=gemm, sum_splits=sum_splits, grouped_gemm=grouped_gemm)


@functools.cache
def _attention() -> SimpleNamespace:
    """Attention over the cache by key chunks, and the chunks' combine."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(q, kc, vc, slots, positions, m_out, l_out, acc_out, scale, T, H, KV, L, n_chunks,
               sq_b, sq_t, sq_h, sk_s, sk_h, sk_l,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr):
        # One query row (b, t), one KV head, one chunk of CH keys: the partial softmax of the G query heads that
        # share the KV head over the chunk's keys up to the row's position.
        row, kv, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, t = row // T, row % T
        pos = tl.load(positions + row)
        slot = tl.load(slots + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kv * G + g
        qv = tl.load(q + b * sq_b + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full((GP,), float("-inf"), tl.float32)
        s_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        start = c * CH
        end = tl.minimum(start + CH, pos + 1)
        base = slot * sk_s + kv * sk_h
        blocks = (end - start + BN - 1) // BN  # none in a chunk past the row's position: work follows the context
        n0 = 0
        while n0 < blocks:
            n = start + n0 * BN + tl.arange(0, BN)
            live = n < end
            kt = tl.load(kc + base + n[:, None] * sk_l + d[None, :], mask=live[:, None], other=0.0)
            vt = tl.load(vc + base + n[:, None] * sk_l + d[None, :], mask=live[:, None], other=0.0)
            s = tl.dot(qv, tl.trans(kt)) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - 0) = 0, not NaN
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            s_sum = s_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
            n0 += 1
        o = ((row * H + heads) * n_chunks + c).to(tl.int64)  # x D passes 2^31 at long contexts
        tl.store(m_out + o, m, mask=g < G)
        tl.store(l_out + o, s_sum, mask=g < G)
        tl.store(acc_out + o[:, None] * D + d[None, :], acc, mask=g[:, None] < G)

    @triton.jit
    def combine(m_in, l_in, acc_in, gate, out, n_chunks, CP: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr):
        # One (row, head): the chunks' partials merged, in chunk order, into the output row; GATE: times
        # sigmoid(gate), each rounded to the output's dtype as torch rounds them.
        rh = tl.program_id(0)
        c = tl.arange(0, CP)
        d = tl.arange(0, D)
        live = c < n_chunks
        m = tl.load(m_in + rh * n_chunks + c, mask=live, other=float("-inf"))
        l_part = tl.load(l_in + rh * n_chunks + c, mask=live, other=0.0)
        a = tl.load(acc_in + (rh * n_chunks + c).to(tl.int64)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(l_part * w, 0)
        o = (tl.sum(a * w[:, None], 0) / total).to(out.dtype.element_ty)
        if GATE:
            z = tl.load(gate + rh * D + d).to(tl.float32)
            o = (o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-z))).to(out.dtype.element_ty).to(tl.float32))
        tl.store(out + rh * D + d, o.to(out.dtype.element_ty))

    return SimpleNamespace(triton=triton, attend=attend, combine=combine)


@functools.cache
def _rows() -> SimpleNamespace:
    """Per-row kernels, each reading a product's split partials (`summed`): add + RMSNorm, q/k norm + rotary with the
    K/V stores, SiLU x up, the gated output norm."""
    import triton
    import triton.language as tl

    global _summed, _biased  # module names: the interpreter resolves a kernel's helpers among its globals only

    @triton.jit
    def _summed(parts, plane, offs, mask, S: tl.constexpr, DT: tl.constexpr):
        # A product's value at offs: its S split partials added in split order in fp32, rounded to the model dtype (as
        # the product's own output would be), returned in fp32.
        total = tl.load(parts + offs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, S):
            total += tl.load(parts + s * plane + offs, mask=mask, other=0.0).to(tl.float32)
        return total.to(DT).to(tl.float32)

    @triton.jit
    def _biased(parts, plane, bias, offs, col, mask, S: tl.constexpr, DT: tl.constexpr, HAS_BIAS: tl.constexpr):
        # _summed, plus the product's bias (added in the model dtype).
        x = _summed(parts, plane, offs, mask, S, DT)
        if HAS_BIAS:
            x = (x + tl.load(bias + col, mask=mask, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
        return x

    @triton.jit
    def add_norm(parts, plane, bias, res, w, y, out_sum, eps, HID: tl.constexpr, BH: tl.constexpr, S: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ZC: tl.constexpr):
        # One row: out_sum = x + res (in the model dtype), y = w * (out_sum * rsqrt(mean(out_sum^2) + eps)) (ZC: the
        # normalised row times 1 + w in fp32); x the product's split partials summed.
        row = tl.program_id(0)
        i = tl.arange(0, BH)
        live = i < HID
        dt = y.dtype.element_ty
        x = _biased(parts, plane, bias, row * HID + i, i, live, S, dt, HAS_BIAS)
        s = (x + tl.load(res + row * HID + i, mask=live, other=0.0).to(tl.float32)).to(dt)
        tl.store(out_sum + row * HID + i, s, mask=live)
        h = s.to(tl.float32)
        r = tl.rsqrt(tl.sum(h * h, 0) / HID + eps)
        weight = tl.load(w + i, mask=live, other=0.0)
        if ZC:
            tl.store(y + row * HID + i, (h * r * (1.0 + weight.to(tl.float32))).to(dt), mask=live)
        else:
            tl.store(y + row * HID + i, weight * (h * r).to(dt), mask=live)

    @triton.jit
    def norm_rope(parts, plane, bias, qw, kw, cos, sin, positions, write_slots, q_out, gate_out, kc, vc, eps, H, KV,
                  NCOL, QS, sk_s, sk_h, sk_l, D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                  ZC: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, GATE: tl.constexpr):
        # One (row, head) of the q, k and v heads of a q/k/v product (q head h at column h QS, its gate after it where
        # GATE; k and v heads after the q heads): q and k RMS-normed with their weight and rotated at the row's position
        # on the first ROT features; q to q_out, k and v stored in the cache at (the row's write slot, position).
        row, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, D)
        dt = q_out.dtype.element_ty
        pos = tl.load(positions + row)
        is_q = head < H
        is_v = head >= H + KV
        col = tl.where(is_q, head * QS, H * QS + (head - H) * D)
        x = _biased(parts, plane, bias, row * NCOL + col + d, col + d, d < D, S, dt, HAS_BIAS)
        dest = tl.load(write_slots + row) * sk_s + (head - H - tl.where(is_v, KV, 0)) * sk_h + pos * sk_l + d
        if is_v:
            tl.store(vc + dest, x.to(dt))
        else:
            half = ROT // 2
            other = tl.where(d < ROT, (d + half) % ROT, d)  # the rotate-half partner of each rotated feature
            partner = _biased(parts, plane, bias, row * NCOL + col + other, col + other, d < D, S, dt, HAS_BIAS)
            if NORM:
                r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
                w = tl.where(is_q, tl.load(qw + d, mask=is_q, other=0.0), tl.load(kw + d, mask=head >= H, other=0.0))
                wp = tl.where(is_q, tl.load(qw + other, mask=is_q, other=0.0),
                              tl.load(kw + other, mask=head >= H, other=0.0))
                if ZC:
                    x = (x * r * (1.0 + w.to(tl.float32))).to(dt).to(tl.float32)
                    partner = (partner * r * (1.0 + wp.to(tl.float32))).to(dt).to(tl.float32)
                else:
                    x = (w * (x * r).to(dt)).to(tl.float32)
                    partner = (wp * (partner * r).to(dt)).to(tl.float32)
            rotating = d < ROT
            c = tl.load(cos + pos * ROT + d, mask=rotating, other=1.0).to(tl.float32)
            s = tl.load(sin + pos * ROT + d, mask=rotating, other=0.0).to(tl.float32)
            rotated = tl.where(d < half, -partner, partner)
            # each product rounded to the model dtype, then their sum: torch's arithmetic in bf16
            y = ((x * c).to(dt).to(tl.float32) + (rotated * s).to(dt).to(tl.float32)).to(dt)
            if is_q:
                tl.store(q_out + (row * H + head) * D + d, y)
                if GATE:
                    g = _biased(parts, plane, bias, row * NCOL + col + D + d, col + D + d, d < D, S, dt, HAS_BIAS)
                    tl.store(gate_out + (row * H + head) * D + d, g.to(dt))
            else:
                tl.store(kc + dest, y)

    @triton.jit
    def silu_mul(parts, plane, bias, out, I, BI: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr):
        # One row, BI columns of a gate/up product (gate columns first): silu(gate) * up, each rounded as torch does.
        row, pc = tl.program_id(0), tl.program_id(1)
        i = pc * BI + tl.arange(0, BI)
        live = i < I
        dt = out.dtype.element_ty
        g = _biased(parts, plane, bias, row * 2 * I + i, i, live, S, dt, HAS_BIAS)
        u = _biased(parts, plane, bias, row * 2 * I + I + i, I + i, live, S, dt, HAS_BIAS)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out + row * I + i, (act * u).to(dt), mask=live)

    @triton.jit
    def gated_norm(x, parts, plane, w, out, eps, NCOL, ZCOL, HV, D: tl.constexpr, S: tl.constexpr):
        # One head of one row: rms_norm(x rounded to the model dtype) * silu(z), z the head's columns of the product
        # from column ZCOL.
        rh = tl.program_id(0)
        row, head = rh // HV, rh % HV
        d = tl.arange(0, D)
        dt = out.dtype.element_ty
        h = tl.load(x + rh * D + d).to(dt).to(tl.float32)
        weight = tl.load(w + d)
        y = (weight * (h * tl.rsqrt(tl.sum(h * h, 0) / D + eps)).to(weight.dtype)).to(tl.float32)
        z = _summed(parts, plane, row * NCOL + ZCOL + head * D + d, d < D, S, dt)
        tl.store(out + rh * D + d, (y * (z / (1.0 + tl.exp(-z)))).to(dt))

    return SimpleNamespace(triton=triton, summed=_summed, add_norm=add_norm, norm_rope=norm_rope, silu_mul=silu_mul,
                           gated_norm=gated_norm)


def triton_dtype(dtype: torch.dtype):
    """Triton's type of a torch dtype."""
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def gemm_config(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, split of K) for a weight [n, k] on a device of `sms` multiprocessors: a function of the weight
    and the device only. K is split until the tiles of one row block fill about two waves of the device, in whole
    BLOCK_K steps."""
    block_n, block_k = (64, 128) if k % 128 == 0 else (64, 32)
    tiles = -(-n // block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and k % (2 * split * block_k) == 0:
        split *= 2
    return block_n, block_k, split


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def triton_linear_parts(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T as its split partials [S, ..., N]: fp32, in the order of K; with S = 1 the product itself
    in x's dtype. Its consumer adds them (`summed`)."""
    kn = _products()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    (m, k), n = x2.shape, w.shape[0]
    block_n, block_k, split = gemm_config(n, k, _sms(x.device))
    parts = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    kn.gemm[(kn.triton.cdiv(m, BLOCK_M), kn.triton.cdiv(n, block_n), split)](
        x2, w, parts, m, n, k, x2.stride(0), w.stride(0), parts.stride(0),
        BM=BLOCK_M, BN=block_n, BK=block_k, K_STEPS=-(-k // (split * block_k)))
    return parts.view(split, *shape[:-1], n)


def triton_sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A product's split partials [S, ..., N] added in split order, in `dtype`."""
    if parts.shape[0] == 1:
        return parts[0].to(dtype)
    kn = _products()
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
    size = out.numel()
    kn.sum_splits[(kn.triton.cdiv(size, 1024),)](parts.contiguous(), out, size, S=parts.shape[0], BLOCK=1024)
    return out


def triton_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return triton_sum_parts(triton_linear_parts(x, w), x.dtype)


def _plane(parts: torch.Tensor) -> int:
    if parts.stride(-1) != 1 or (parts.shape[0] > 1 and not parts.is_contiguous()):
        raise ValueError("a product's partials must be dense")
    return parts[0].numel()


def _bias(bias: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (like, False) if bias is None else (bias, True)


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    kn = _attention()
    B, T, H, D = q.shape
    _, KV, L, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("cache_attention needs the caches alike and the last dimension of q and the caches dense")
    G = H // KV
    chunk = attention_chunk(L)
    n_chunks = -(-L // chunk)
    rows = B * T
    m = torch.empty((rows, H, n_chunks), dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    acc = torch.empty((rows, H, n_chunks, D), dtype=torch.float32, device=q.device)
    positions = positions.reshape(-1)
    kn.attend[(rows, KV, n_chunks)](
        q, k_cache, v_cache, slots, positions, m, s, acc, scale, T, H, KV, L, n_chunks,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=G, GP=max(16, kn.triton.next_power_of_2(G)), D=D, CH=chunk, BN=ATTN_BLOCK_N)
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    kn.combine[(rows * H,)](m, s, acc, out if gate is None else gate, out, n_chunks,
                            CP=max(2, kn.triton.next_power_of_2(n_chunks)), D=D, GATE=gate is not None)
    return out


def attention_chunk(max_len: int) -> int:
    """Keys per attention split for a cache of max_len positions: CHUNK, or longer (in whole key blocks) where that
    would make more than MAX_SPLITS splits. A function of the cache alone, never of the batch: a row's keys are split
    and combined in the same order in any batch. The fp32 partials take rows x heads x splits x (head_dim + 2)."""
    return max(CHUNK, -(-max_len // (MAX_SPLITS * ATTN_BLOCK_N)) * ATTN_BLOCK_N)


def triton_add_rms_norm(parts: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    kn = _rows()
    hidden = residual.shape[-1]
    residual = residual.contiguous()
    y, summed = torch.empty_like(residual), torch.empty_like(residual)
    bias, has_bias = _bias(bias, residual)
    kn.add_norm[(residual.numel() // hidden,)](parts, _plane(parts), bias, residual, weight, y, summed, eps, HID=hidden,
                                               BH=kn.triton.next_power_of_2(hidden), S=parts.shape[0],
                                               HAS_BIAS=has_bias, ZC=zero_centred)
    return y, summed


def triton_attention_inputs(parts: torch.Tensor, bias: torch.Tensor | None, q_weight: torch.Tensor,
                            k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                            write_slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                            kv_heads: int, eps: float, zero_centred: bool = False, gated: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    kn = _rows()
    _, B, T, ncol = parts.shape
    D = k_cache.shape[-1]
    q = parts.new_empty((B, T, heads, D), dtype=k_cache.dtype)
    gate = torch.empty_like(q) if gated else q.new_empty((B, T, heads, 0))
    norm = bool(q_weight.numel())
    qw, kw = (q_weight, k_weight) if norm else (cos, cos)  # unread without the norm
    bias, has_bias = _bias(bias, cos)
    kn.norm_rope[(B * T, heads + 2 * kv_heads)](
        parts, _plane(parts), bias, qw, kw, cos, sin, positions, write_slots, q, gate if gated else q, k_cache,
        v_cache, eps, heads, kv_heads, ncol, 2 * D if gated else D, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), D=D, ROT=cos.shape[-1], NORM=norm, ZC=zero_centred, S=parts.shape[0], HAS_BIAS=has_bias,
        GATE=gated)
    return q, gate


def triton_silu_mul(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    kn = _rows()
    width = parts.shape[-1] // 2
    out = torch.empty((*parts.shape[1:-1], width), dtype=dtype, device=parts.device)
    bias, has_bias = _bias(bias, out)
    kn.silu_mul[(out.numel() // width, kn.triton.cdiv(width, 1024))](parts, _plane(parts), bias, out, width, BI=1024,
                                                                     S=parts.shape[0], HAS_BIAS=has_bias)
    return out


def triton_gated_rms_norm(x: torch.Tensor, parts: torch.Tensor, z_col: int, weight: torch.Tensor,
                          eps: float, dtype: torch.dtype) -> torch.Tensor:
    kn = _rows()
    B, T, HV, D = x.shape
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    kn.gated_norm[(B * T * HV,)](x, parts, _plane(parts), weight, out, eps, parts.shape[-1], z_col, HV, D=D,
                                 S=parts.shape[0])
    return out


MOE_BLOCK = 16  # rows of one expert per grouped-GEMM block, whatever the token count


def moe_layout(ids: torch.Tensor, experts: int,
               block: int = MOE_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, rank) pairs of ids [N, top_k] grouped by expert, each group padded to whole blocks, in a layout of
    static size (N top_k + experts (block - 1), rounded up to a block): (rows [size]: the pair index p = token top_k +
    rank at each position, -1 for padding; block_expert [size / block]: each block's expert, `experts` for an unused
    block; at [N top_k]: each pair's position). Device operations only: no count is read back."""
    pairs = ids.numel()
    flat = ids.reshape(-1)
    size = -(-(pairs + experts * (block - 1)) // block) * block
    order = torch.sort(flat, stable=True).indices  # pair indices grouped by expert, each group in pair order
    # [E]; not bincount, whose output size hangs on the largest id (a read back, which a graph capture refuses)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    start = torch.cumsum(padded, 0) - padded  # each expert's first position in the layout
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    expert_of = flat[order]
    rank = torch.arange(pairs, device=ids.device) - first[expert_of]
    rows = torch.full((size,), -1, dtype=torch.long, device=ids.device)
    rows[start[expert_of] + rank] = order
    ends = torch.cumsum(padded, 0)  # [E]: the layout position after each expert's group
    block_starts = torch.arange(0, size, block, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # E where the block is past every group
    at = torch.empty(pairs, dtype=torch.long, device=ids.device)
    at[order] = start[expert_of] + rank
    return rows, block_expert, at


def triton_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    kn = _products()
    N, H = x.shape
    E = gate_up.shape[0]
    top_k = ids.shape[1]
    rows, block_expert, at = moe_layout(ids, E)
    size = rows.shape[0]
    x = x.contiguous()

    def grouped(inp: torch.Tensor, w: torch.Tensor, rows_per_x: int, src: torch.Tensor) -> torch.Tensor:
        n_out, k = w.shape[1], w.shape[2]
        out = torch.empty((size, n_out), dtype=inp.dtype, device=inp.device)
        block_k = 128 if k % 128 == 0 else 32
        kn.grouped_gemm[(size // MOE_BLOCK, kn.triton.cdiv(n_out, 64))](
            inp, w, src, block_expert, out, n_out, k, E, rows_per_x, w.stride(0), w.stride(1),
            BM=MOE_BLOCK, BN=64, BK=block_k, K_STEPS=-(-k // block_k))
        return out

    gu = grouped(x, gate_up, top_k, rows)  # [size, 2 I]: row r is pair rows[r]'s token through its expert
    gate, up = gu.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # [size, I]
    positions = torch.arange(size, device=x.device)
    y = grouped(act, down, 1, torch.where(rows >= 0, positions, -1))  # [size, H]
    y = y[at].view(N, top_k, H)  # back in (token, rank) order
    out = y[:, 0] * weights[:, 0, None]
    for j in range(1, top_k):  # the ranks in order
        out = out + y[:, j] * weights[:, j, None]
    return out
