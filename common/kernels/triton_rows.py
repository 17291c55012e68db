"""The per-row Triton kernels behind `gpu_kernels`' operators on CUDA, and their launchers: each reads a product's
split partials (`_summed`: added in split order, rounded to the model dtype) - add + RMSNorm, q/k norm + rotary with
the K/V stores, SiLU x up, a Gated DeltaNet's gated output norm. Triton is imported on first use; `TRITON_INTERPRET=1`
runs them on CPU tensors (tests/common/runtime/test_cuda_runner.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


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
    def norm_rope(parts, plane, bias, qw, kw, cos, sin, positions, write_blocks, q_out, gate_out, kc, vc, eps, H, KV,
                  NCOL, QS, sk_b, sk_h, sk_l, block_len, D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                  ZC: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, GATE: tl.constexpr):
        # One (row, head) of the q, k and v heads of a q/k/v product (q head h at column h QS, its gate after it where
        # GATE; k and v heads after the q heads): q and k RMS-normed with their weight and rotated at the row's position
        # on the first ROT features; q to q_out, k and v stored in the cache at (the row's write block, its position
        # modulo the block length).
        row, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, D)
        dt = q_out.dtype.element_ty
        pos = tl.load(positions + row)
        is_q = head < H
        is_v = head >= H + KV
        col = tl.where(is_q, head * QS, H * QS + (head - H) * D)
        x = _biased(parts, plane, bias, row * NCOL + col + d, col + d, d < D, S, dt, HAS_BIAS)
        dest = (tl.load(write_blocks + row) * sk_b + (head - H - tl.where(is_v, KV, 0)) * sk_h + (pos % block_len) * sk_l
                + d)
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


def _plane(parts: torch.Tensor) -> int:
    if parts.stride(-1) != 1 or (parts.shape[0] > 1 and not parts.is_contiguous()):
        raise ValueError("a product's partials must be dense")
    return parts[0].numel()


def _bias(bias: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (like, False) if bias is None else (bias, True)


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
                            write_blocks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
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
        parts, _plane(parts), bias, qw, kw, cos, sin, positions, write_blocks, q, gate if gated else q, k_cache,
        v_cache, eps, heads, kv_heads, ncol, 2 * D if gated else D, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_cache.shape[2], D=D, ROT=cos.shape[-1], NORM=norm, ZC=zero_centred, S=parts.shape[0], HAS_BIAS=has_bias,
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
