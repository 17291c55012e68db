"""The Triton kernels of a Gated DeltaNet layer behind `gpu_kernels`' operators on CUDA, and their launchers: the causal
convolution (which also writes each slot's next convolution state), the gates, the delta-rule recurrence (reading and
writing each slot's state buffers in place, one launch for any number of tokens) and the rollback of every slot and
layer in one launch. They read the layer's input product as its split partials (`triton_rows._summed`).
Triton is imported on first use; `TRITON_INTERPRET=1` runs them on CPU tensors
(tests/common/runtime/test_cuda_runner.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from blockspec.common.kernels import triton_rows as tr


@functools.cache
def _deltanet() -> SimpleNamespace:
    """A Gated DeltaNet's convolution, gates, recurrence and rollback."""
    import triton
    import triton.language as tl

    global _summed, _token  # module names: the interpreter resolves a kernel's helpers among its globals only
    _summed = tr._rows().summed

    @triton.jit
    def conv(parts, plane, NCOL, state, ss_slot, ss_buf, slots, reads, real, w, both, T, C, K1, BC: tl.constexpr,
             K: tl.constexpr, S: tl.constexpr):
        # One (request, t), BC channels. t < T: both[b, t, 0] = the convolution's input at t (the product's first C
        # columns), both[b, t, 1] = silu(sum_j w[c, j] x[t + j]) over [state, inputs], taps in order in fp32.
        # t = T + j: the next state's column j, the input at n + j of [state, inputs] (n the row's real tokens),
        # written to the slot's other buffer.
        b, t, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        c = pc * BC + tl.arange(0, BC)
        live = c < C
        dt = both.dtype.element_ty
        slot = tl.load(slots + b)
        read = tl.load(reads + b)
        src = state + slot * ss_slot + read * ss_buf + c * K1
        if t < T:
            acc = tl.zeros((BC,), tl.float32)
            for j in range(K):
                i = t + j  # position in [state, inputs]
                from_state = i < K1
                x_state = tl.load(src + i, mask=live & from_state, other=0.0).to(tl.float32)
                x_new = _summed(parts, plane, (b * T + i - K1) * NCOL + c, live & (i >= K1), S, dt)
                acc = acc + tl.load(w + c * K + j, mask=live, other=0.0) * tl.where(from_state, x_state, x_new)
            x_t = _summed(parts, plane, (b * T + t) * NCOL + c, live, S, dt)
            tl.store(both + ((b * T + t) * 2) * C + c, x_t.to(dt), mask=live)
            tl.store(both + ((b * T + t) * 2 + 1) * C + c, (acc / (1.0 + tl.exp(-acc))).to(dt), mask=live)
        else:
            n = tl.load(real + b * T).to(tl.int32)
            u = 1
            while u < T:  # runtime bounds as while loops: Triton's interpreter takes no runtime range()
                n += tl.load(real + b * T + u).to(tl.int32)
                u += 1
            i = n + t - T
            x_state = tl.load(src + i, mask=live & (i < K1), other=0.0).to(tl.float32)
            x_new = _summed(parts, plane, (b * T + i - K1) * NCOL + c, live & (i >= K1), S, dt)
            dst = state + slot * ss_slot + (1 - read) * ss_buf + c * K1 + t - T
            tl.store(dst, tl.where(i < K1, x_state, x_new).to(dt), mask=live)

    @triton.jit
    def gates(parts, plane, NCOL, col_b, col_a, a_log, dt_bias, real, out, HV, BH: tl.constexpr, S: tl.constexpr,
              DT: tl.constexpr):
        # One (request, position): every value head's log decay g and write strength beta (out[row, 0] and [row, 1]),
        # both 0 at padding; a and b the product's columns from col_a and col_b.
        bt = tl.program_id(0)
        h = tl.arange(0, BH)
        live = h < HV
        keep = tl.load(real + bt).to(tl.float32)
        av = _summed(parts, plane, bt * NCOL + col_a + h, live, S, DT)
        av = av + tl.load(dt_bias + h, mask=live, other=0.0).to(tl.float32)
        # softplus = max(a, 0) + log1p(exp(-|a|)), log1p by Kahan's correction (torch: log1p(exp(a)), a itself past 20)
        u = tl.exp(-tl.abs(av))
        w = 1.0 + u
        softplus = tl.where(av > 20.0, av, tl.maximum(av, 0.0) + tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0)))
        decay = -tl.exp(tl.load(a_log + h, mask=live, other=0.0).to(tl.float32)) * softplus
        bv = _summed(parts, plane, bt * NCOL + col_b + h, live, S, DT)
        tl.store(out + bt * 2 * HV + h, decay * keep, mask=live)
        tl.store(out + (bt * 2 + 1) * HV + h, keep / (1.0 + tl.exp(-bv)), mask=live)

    @triton.jit
    def _token(s, kt, vt, g, beta):
        # One token of the gated delta rule on the state block s [DK, BV]: k l2-normalised here.
        kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
        s = s * tl.exp(g)
        delta = (vt - tl.sum(s * kt[:, None], 0)) * beta
        return s + kt[:, None] * delta[None, :]

    @triton.jit
    def delta_rule(rec, sr_slot, sr_buf, slots, reads, both, gts, out, scale, T, HV, HK, C,
                   DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        # One request, one value head, BV value columns: the state block [DK, BV] read from the slot's current buffer,
        # kept on chip over the T tokens (a runtime bound), written to its other buffer. q, k, v: both[b, t, 1].
        b, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        dk = tl.arange(0, DK)
        dv = j * BV + tl.arange(0, BV)
        slot = tl.load(slots + b)
        read = tl.load(reads + b)
        block = dk[:, None] * DV + dv[None, :]
        s = tl.load(rec + slot * sr_slot + read * sr_buf + h * DK * DV + block)
        kh = h // (HV // HK)  # the key head serving this value head
        t = 0
        while t < T:
            row = b * T + t
            x = both + (row * 2 + 1) * C
            qt = tl.load(x + kh * DK + dk).to(tl.float32)
            qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6) * scale
            s = _token(s, tl.load(x + (HK + kh) * DK + dk).to(tl.float32),
                      tl.load(x + 2 * HK * DK + h * DV + dv).to(tl.float32),
                      tl.load(gts + row * 2 * HV + h), tl.load(gts + (row * 2 + 1) * HV + h))
            tl.store(out + (row * HV + h) * DV + dv, tl.sum(s * qt[:, None], 0))
            t += 1
        tl.store(rec + slot * sr_slot + (1 - read) * sr_buf + h * DK * DV + block, s)

    @triton.jit
    def rollback(rec, sr_layer, sr_slot, sr_buf, conv, sc_layer, sc_slot, sc_buf, kept, kl_layer, kl_slot, gk, gk_layer,
                 gk_slot, slots, current, counts, R, HV, HK, C, K1, NVB, DK: tl.constexpr, DV: tl.constexpr,
                 BV: tl.constexpr, BC: tl.constexpr):
        # One (layer, slot), one value head, BV value columns: the slot's current buffers become its other buffers
        # advanced by its first `count` kept tokens (the recurrence of `delta_rule`; the convolution state the last K1
        # inputs of [state, kept inputs]), and BC channels of the convolution state.
        lr, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        layer, r = (lr // R).to(tl.int64), lr % R  # layer x its stride passes 2^31 with many slots
        slot = tl.load(slots + r)
        cur = tl.load(current + r)
        n = tl.load(counts + r)
        dk = tl.arange(0, DK)
        dv = j * BV + tl.arange(0, BV)
        block = dk[:, None] * DV + dv[None, :]
        base = rec + layer * sr_layer + slot * sr_slot + h * DK * DV + block
        s = tl.load(base + (1 - cur) * sr_buf)
        kh = h // (HV // HK)
        kept_at = kept + layer * kl_layer + slot * kl_slot
        gates_at = gk + layer * gk_layer + slot * gk_slot
        t = 0
        while t < n:
            x = kept_at + (t * 2 + 1) * C
            s = _token(s, tl.load(x + (HK + kh) * DK + dk).to(tl.float32),
                       tl.load(x + 2 * HK * DK + h * DV + dv).to(tl.float32),
                       tl.load(gates_at + t * 2 * HV + h), tl.load(gates_at + (t * 2 + 1) * HV + h))
            t += 1
        tl.store(base + cur * sr_buf, s)
        c = (h * NVB + j) * BC + tl.arange(0, BC)
        live = c < C
        conv_at = conv + layer * sc_layer + slot * sc_slot + c * K1
        u = 0
        while u < K1:
            i = n + u  # in [state, kept inputs]
            old = tl.load(conv_at + (1 - cur) * sc_buf + i, mask=live & (i < K1), other=0.0)
            new = tl.load(kept_at + (i - K1) * 2 * C + c, mask=live & (i >= K1), other=0.0)
            tl.store(conv_at + cur * sc_buf + u, tl.where(i < K1, old, new), mask=live)
            u += 1

    return SimpleNamespace(triton=triton, conv=conv, gates=gates, delta_rule=delta_rule, rollback=rollback)


def triton_causal_conv(parts: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor,
                       real: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kn = _deltanet()
    _, B, T, ncol = parts.shape
    C, K = weight.shape
    both = torch.empty((B, T, 2, C), dtype=dtype, device=parts.device)
    kn.conv[(B, T + K - 1, kn.triton.cdiv(C, 128))](parts, tr._plane(parts), ncol, state, state.stride(0),
                                                  state.stride(1), slots, reads, real, weight, both, T, C, K - 1,
                                                  BC=128, K=K, S=parts.shape[0])
    return both


def triton_delta_gates(parts: torch.Tensor, col_b: int, col_a: int, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kn = _deltanet()
    _, B, T, ncol = parts.shape
    HV = a_log.shape[0]
    out = torch.empty((B, T, 2, HV), dtype=torch.float32, device=parts.device)
    kn.gates[(B * T,)](parts, tr._plane(parts), ncol, col_b, col_a, a_log, dt_bias, real, out, HV,
                       BH=kn.triton.next_power_of_2(HV), S=parts.shape[0], DT=tr.triton_dtype(dtype))
    return out


def triton_gated_delta_rule(rec: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor, both: torch.Tensor,
                            gates: torch.Tensor, key_heads: int, scale: float) -> torch.Tensor:
    kn = _deltanet()
    B, T, _, C = both.shape
    HV, DK, DV = rec.shape[2:]
    out = torch.empty((B, T, HV, DV), dtype=torch.float32, device=both.device)
    block_v = min(64, DV)
    # no fused multiply-adds here or in the rollback: both compile `_token` to the same operations, so a state rolled
    # back equals the one the step wrote for those tokens, bit for bit
    kn.delta_rule[(B, HV, DV // block_v)](rec, rec.stride(0), rec.stride(1), slots, reads, both, gates, out, scale, T,
                                          HV, key_heads, C, DK=DK, DV=DV, BV=block_v, enable_fp_fusion=False)
    return out


def triton_rollback(rec: torch.Tensor, conv: torch.Tensor, kept: torch.Tensor, kept_gates: torch.Tensor,
                    slots: torch.Tensor, current: torch.Tensor, counts: torch.Tensor, key_heads: int) -> None:
    kn = _deltanet()
    L, R = rec.shape[0], slots.shape[0]
    HV, DK, DV = rec.shape[3:]
    C, K1 = conv.shape[3:]
    block_v = min(64, DV)
    nvb = DV // block_v
    block_c = kn.triton.next_power_of_2(-(-C // (HV * nvb)))
    kn.rollback[(L * R, HV, nvb)](rec, rec.stride(0), rec.stride(1), rec.stride(2), conv, conv.stride(0),
                                  conv.stride(1), conv.stride(2), kept, kept.stride(0), kept.stride(1), kept_gates,
                                  kept_gates.stride(0), kept_gates.stride(1), slots, current, counts, R, HV, key_heads,
                                  C, K1, nvb, DK=DK, DV=DV, BV=block_v, BC=block_c, enable_fp_fusion=False)
