"""The gated delta rule in torch: one token at a time (a hybrid model's decode and verify blocks on the CPU, their
rollback by replay in models/state_cache.py, the reference of the GPU's recurrence kernel in gpu_kernels.py) and in
chunks (its long prefill blocks: a few matmuls a chunk)."""

from __future__ import annotations

import math

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




def _chunks(x: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] -> [n * B * H, chunk, ...] (chunk-major), the tail padded with zeros (where g = beta = 0: tokens
    that change nothing)."""
    pad = n * chunk - x.shape[1]
    if pad:
        x = torch.cat((x, x.new_zeros(x.shape[0], pad, *x.shape[2:])), dim=1)
    x = x.reshape(x.shape[0], n, chunk, *x.shape[2:]).movedim((1, 3), (0, 2))  # [n, B, H, chunk, ...]
    return x.reshape(-1, chunk, *x.shape[4:])


def delta_rule_chunked(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       q: torch.Tensor | None = None, chunk: int = 32
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`delta_rule_steps` (same shapes, fp32, no kept states) over chunks of `chunk` tokens, equal to it within
    rounding (errors of about 1e-6 of the result's max abs). Within a chunk, with G_t the cumulative log decay and S
    the chunk's initial state, token t writes d_t = beta_t (v_t - e^G_t S^T k_t - sum_{i<t} e^(G_t - G_i) (k_t . k_i)
    d_i): a unit lower-triangular system (I + A) D = beta V - beta e^G K S, so D = U - W S with U, W solved for every
    chunk at once. The loop over chunks then costs four matmuls each: D, the outputs e^G_t S^T q_t + sum_{i<=t}
    e^(G_t - G_i) (q_t . k_i) d_i, and the next state e^G_last S + sum_i e^(G_last - G_i) k_i d_i^T. Every exponent
    is a difference G_t - G_i <= 0 (masked to -inf above the diagonal before exp). A token with g = beta = 0 writes
    d = 0 and changes nothing, so a row's padding leaves its state as its own tokens left it. The work per token
    within chunks grows with the chunk, the loop's does not: the default 32 keeps the first small while the loop's
    matmuls stay large."""
    B, T, H, dk = k.shape
    dv, rows, n = v.shape[-1], B * H, -(-T // chunk)
    k, v, g, beta = (_chunks(t, n, chunk) for t in (k, v, g, beta))  # [n * rows, C, ...], chunk c at c * rows
    G = g.cumsum(-1)  # [n * rows, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, -math.inf).exp()  # [n * rows, C, C]: e^(G_t - G_i)
    a = (torch.bmm(k, k.mT) * decay * beta[:, :, None]).tril(-1)  # A[t, i], i < t
    inverse = torch.linalg.solve_triangular(a, torch.eye(chunk, device=k.device), upper=False, unitriangular=True)
    u = torch.bmm(inverse * beta[:, None, :], v).view(n, rows, chunk, dv)  # (I + A)^-1 diag(beta) V
    w = torch.bmm(inverse * (beta * G.exp())[:, None, :], k).view(n, rows, chunk, dk)
    last = G[:, -1:]  # [n * rows, 1]
    to_end = (last - G).exp().view(n, rows, chunk, 1)  # e^(G_last - G_i)
    chunk_decay = last.exp().view(n, rows, 1, 1)
    k_t = k.mT.view(n, rows, dk, chunk)
    state = state.reshape(rows, dk, dv)
    if q is not None:
        q = _chunks(q, n, chunk)
        q_scores = (torch.bmm(q, k.mT) * decay).view(n, rows, chunk, chunk)
        q_decayed = (q * G.exp()[..., None]).view(n, rows, chunk, dk)
        out = torch.empty(n, rows, chunk, dv, dtype=torch.float32, device=v.device)
    for c in range(n):
        d = torch.baddbmm(u[c], w[c], state, alpha=-1)  # [rows, C, dv]
        if q is not None:
            torch.bmm(q_decayed[c], state, out=out[c]).baddbmm_(q_scores[c], d)
        state = (state * chunk_decay[c]).baddbmm_(k_t[c], d * to_end[c])
    state = state.view(B, H, dk, dv)
    if q is None:
        return None, state
    out = out.view(n, B, H, chunk, dv).movedim((0, 2), (1, 3)).reshape(B, n * chunk, H, dv)
    return out[:, :T].contiguous(), state


PREFILL_BLOCK = 32  # a prompt's whole blocks of this many positions from position 0 run the chunked form


def prefill_blocks(starts: list[int], counts: list[int], block: int = PREFILL_BLOCK) -> list[int]:
    """Per row of a forward, how many of its leading tokens run the chunked form: its whole blocks of `block`
    positions where it starts on a block boundary (a prompt is split into forwards on block boundaries only,
    `Verifier.prefill`), none where it does not. The rest run token by token. A token's arithmetic then depends on its
    position alone, not on how its prompt was split into forwards or batched: the same in plain and speculative
    decoding whatever else is running."""
    return [n // block * block if start % block == 0 else 0 for start, n in zip(starts, counts)]


def delta_rule_prefill(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       q: torch.Tensor, chunked: list[int], block: int = PREFILL_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule_steps` (same shapes) with each row's first chunked[b] tokens (whole blocks, `prefill_blocks`) run
    by `delta_rule_chunked` in chunks of `block`, and its tokens after them token by token. A row's tokens past its
    count, and its padding, enter as g = beta = 0 (no change to its state)."""
    B, T = k.shape[:2]
    top = max(chunked)
    if top == 0:
        return delta_rule_steps(state, k, v, g, beta, q)
    device = k.device
    lead = (torch.arange(top, device=device)[None, :] < torch.tensor(chunked, device=device)[:, None]).float()
    out_lead, state = delta_rule_chunked(state, k[:, :top], v[:, :top], g[:, :top] * lead[..., None],
                                         beta[:, :top] * lead[..., None], q[:, :top], block)
    width = T - min(chunked)  # the tokens after each row's chunked ones, gathered to the front
    if width == 0:
        return out_lead, state
    index = torch.tensor(chunked, device=device)[:, None] + torch.arange(width, device=device)  # [B, width]
    inside = index < T
    index = index.clamp(max=T - 1)

    def rest(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index.view(B, width, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))

    live = inside.float()[..., None]
    out_rest, state = delta_rule_steps(state, rest(k), rest(v), rest(g) * live, rest(beta) * live, rest(q))
    out = torch.empty(B, T + 1, *v.shape[2:], dtype=torch.float32, device=device)  # column T: a sink
    out[:, :top] = out_lead
    sink = torch.where(inside, index, T)
    out.scatter_(1, sink.view(B, width, 1, 1).expand(-1, -1, *out.shape[2:]), out_rest)
    return out[:, :T], state

