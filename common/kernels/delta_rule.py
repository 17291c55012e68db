"""The gated delta rule in torch, one token at a time: a hybrid model's linear-attention layers on the CPU, their
rollback by replay (models/state_cache.py) and the reference of the GPU's recurrence kernel (gpu_kernels.py)."""

from __future__ import annotations

import torch


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dimension, as the Gated DeltaNet reference computes it (fp32, eps 1e-6 inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def delta_rule_steps(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     q: torch.Tensor | None = None, keep: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time, in fp32: state [B, Hv, dk, dv]; k [B, T, Hv, dk] (l2-normalised),
    v [B, T, Hv, dv], g [B, T, Hv] (log decay), beta [B, T, Hv]; q [B, T, Hv, dk] (normalised and scaled) or None.
    Per token: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q. A padding token has g = beta = 0, which
    leaves S bitwise unchanged. keep [B, T, Hv, dk, dv]: the state after every token is written there. Returns the
    outputs [B, T, Hv, dv] (None without q) and the final state."""
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device) if q is not None else None
    decay = g.exp()[..., None, None]  # [B, T, Hv, 1, 1]
    for t in range(k.shape[1]):
        k_t = k[:, t, :, :, None]  # [B, Hv, dk, 1]
        state = state * decay[:, t]
        kv_mem = (state * k_t).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k_t * delta[:, :, None, :]
        if q is not None:
            out[:, t] = (state * q[:, t, :, :, None]).sum(dim=-2)
        if keep is not None:
            keep[:, t] = state
    return out, state
