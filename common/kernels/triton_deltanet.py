"""The Triton kernels of a Gated DeltaNet layer behind `gpu_kernels`' operators on CUDA, and their launchers: the causal
convolution, the gates and the delta-rule recurrence. Triton is imported on first use; `TRITON_INTERPRET=1` runs them
on CPU tensors (tests/common/runtime/test_cuda_runner.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


@functools.cache
def _deltanet() -> SimpleNamespace:
    """A Gated DeltaNet's convolution, gates and recurrence."""
    import triton
    import triton.language as tl

    @triton.jit
    def conv(state, mixed, w, out, T, C, K1, BC: tl.constexpr, K: tl.constexpr):
        # One (request, position t), BC channels: silu(sum_j w[c, j] x[t + j]) over [state, mixed], taps in order.
        bt, pc = tl.program_id(0), tl.program_id(1)
        b, t = bt // T, bt % T
        c = pc * BC + tl.arange(0, BC)
        live = c < C
        acc = tl.zeros((BC,), tl.float32)
        for j in range(K):
            i = t + j  # position in [state, mixed]
            from_state = i < K1
            x_state = tl.load(state + (b * C + c) * K1 + i, mask=live & from_state, other=0.0)
            x_new = tl.load(mixed + (b * T + i - K1) * C + c, mask=live & (i >= K1), other=0.0)
            x = tl.where(from_state, x_state.to(tl.float32), x_new.to(tl.float32))
            acc = acc + tl.load(w + c * K + j, mask=live, other=0.0) * x
        tl.store(out + (b * T + t) * C + c, (acc / (1.0 + tl.exp(-acc))).to(out.dtype.element_ty), mask=live)

    @triton.jit
    def gates(a, b, a_log, dt_bias, real, g_out, beta_out, T, HV, BH: tl.constexpr):
        # One (request, position): every value head's g and beta, 0 at padding.
        bt = tl.program_id(0)
        h = tl.arange(0, BH)
        live = h < HV
        keep = tl.load(real + bt).to(tl.float32)
        av = tl.load(a + bt * HV + h, mask=live, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=live, other=0.0).to(tl.float32)
        softplus = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(av)))
        decay = -tl.exp(tl.load(a_log + h, mask=live, other=0.0).to(tl.float32)) * softplus
        bv = tl.load(b + bt * HV + h, mask=live, other=0.0).to(tl.float32)
        tl.store(g_out + bt * HV + h, decay * keep, mask=live)
        tl.store(beta_out + bt * HV + h, keep / (1.0 + tl.exp(-bv)), mask=live)

    @triton.jit
    def delta_rule(state, q, k, v, g, beta, out, new_state, scale, HV, HK,
                   T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        # One request, one value head, BV value columns: the state block [DK, BV] stays on chip over the T tokens.
        b, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        dk = tl.arange(0, DK)
        dv = j * BV + tl.arange(0, BV)
        base = (b * HV + h) * DK * DV
        s = tl.load(state + base + dk[:, None] * DV + dv[None, :])
        for t in range(T):
            row = (b * T + t) * HV + h
            key_row = (b * T + t) * HK + h // (HV // HK)  # the key head serving this value head
            kt = tl.load(k + key_row * DK + dk).to(tl.float32)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
            qt = tl.load(q + key_row * DK + dk).to(tl.float32)
            qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6) * scale
            vt = tl.load(v + row * DV + dv).to(tl.float32)
            s = s * tl.exp(tl.load(g + row).to(tl.float32))
            delta = (vt - tl.sum(s * kt[:, None], 0)) * tl.load(beta + row).to(tl.float32)
            s = s + kt[:, None] * delta[None, :]
            tl.store(out + row * DV + dv, tl.sum(s * qt[:, None], 0))
        tl.store(new_state + base + dk[:, None] * DV + dv[None, :], s)

    return SimpleNamespace(triton=triton, conv=conv, gates=gates, delta_rule=delta_rule)


DELTA_BLOCK = 16  # tokens per delta-rule program: a longer block runs as consecutive calls


def triton_gated_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kn = _deltanet()
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2], v.shape[3]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty((B, T, HV, DV), dtype=torch.float32, device=v.device)
    block_v = min(64, DV)
    for t0 in range(0, T, DELTA_BLOCK):  # the state of one call is the next one's: the same order as one call
        t1 = min(T, t0 + DELTA_BLOCK)
        new_state = torch.empty_like(state)
        piece = [x[:, t0:t1].contiguous() for x in (q, k, v, g, beta)]
        chunk_out = torch.empty((B, t1 - t0, HV, DV), dtype=torch.float32, device=v.device)
        kn.delta_rule[(B, HV, DV // block_v)](state.contiguous(), *piece, chunk_out, new_state, scale, HV, HK, T=t1 - t0,
                                           DK=DK, DV=DV, BV=block_v)
        out[:, t0:t1] = chunk_out
        state = new_state
    return out, state


def triton_causal_conv(state: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    kn = _deltanet()
    B, T, C = mixed.shape
    K = weight.shape[1]
    state, mixed = state.contiguous(), mixed.contiguous()
    out = torch.empty_like(mixed)
    kn.conv[(B * T, kn.triton.cdiv(C, 128))](state, mixed, weight.contiguous(), out, T, C, K - 1, BC=128, K=K)
    return out


def triton_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kn = _deltanet()
    B, T, HV = a.shape
    g, beta = (torch.empty((B, T, HV), dtype=torch.float32, device=a.device) for _ in range(2))
    kn.gates[(B * T,)](a.contiguous(), b.contiguous(), a_log, dt_bias, real.contiguous(), g, beta, T, HV,
                       BH=kn.triton.next_power_of_2(HV))
    return g, beta
