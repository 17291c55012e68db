"""The torch references of `gpu_kernels`' operators: what each operator computes on the CPU, and what its CUDA kernel
(`triton_kernels.py`, `triton_deltanet.py`) is tested against. A product's split partials (`linear_parts`) are summed
here by `sum_parts`."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from blockspec.common.kernels.delta_rule import delta_rule_steps, l2_normalise


def linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def sum_parts(parts: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A product's value from its split partials [S, ..., N] (`linear_parts`): added in split order in fp32, rounded to
    dtype, plus the bias in dtype."""
    total = parts[0] if parts.shape[0] == 1 else functools.reduce(torch.add, parts.float().unbind(0))
    total = total.to(dtype)
    return total if bias is None else total + bias


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, H, D], caches [blocks, KV, block_len, D], tables [B, nb] (key j of row b in block tables[b, j //
    block_len] at j % block_len), positions [B, T]: each row attends to keys [0, position] -> [B, T, H, D] (times
    sigmoid(gate) where given)."""
    B, nb = tables.shape
    KV, BS, D = k_cache.shape[1:]
    keys, values = (c[tables].transpose(1, 2).reshape(B, KV, nb * BS, D) for c in (k_cache, v_cache))  # [B, KV, L, D]
    mask = (torch.arange(nb * BS, device=q.device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True).transpose(1, 2)  # [B, T, H, D]
    return out if gate is None else out * torch.sigmoid(gate)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """transformers' arithmetic: normalise in fp32, scale in the model dtype; zero_centred (the Qwen3.5 hybrids): scale
    by 1 + weight in fp32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype) if zero_centred else weight * h.to(x.dtype)


def add_rms_norm_reference(parts: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float, zero_centred: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = sum_parts(parts, residual.dtype, bias) + residual
    return rms_norm_reference(summed, weight, eps, zero_centred), summed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout: x [..., heads, D], cos / sin [..., 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs_reference(parts: torch.Tensor, bias: torch.Tensor | None, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                               write_blocks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                               kv_heads: int, eps: float, zero_centred: bool = False, gated: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A q/k/v product's split partials [S, B, T, columns] (q heads first, each followed by its gate where gated, then
    the k and the v heads) -> (q [B, T, heads, D], the gates [B, T, heads, D] or an empty tensor); q and k RMS-normed
    with their weights (where not empty) and rotated at their positions on the first R features (cos / sin tables
    [max_len, R]); k and v stored in the caches [blocks, kv_heads, block_len, D] at (write_blocks, positions modulo
    block_len)."""
    D = k_cache.shape[-1]
    y = sum_parts(parts, k_cache.dtype, bias)
    B, T = y.shape[:2]
    qs = 2 * D if gated else D
    q_all = y[..., : heads * qs].view(B, T, heads, qs)
    q, gate = q_all[..., :D], q_all[..., D:]
    k = y[..., heads * qs : heads * qs + kv_heads * D].view(B, T, kv_heads, D)
    v = y[..., heads * qs + kv_heads * D :].view(B, T, kv_heads, D)
    if q_weight.numel():
        q, k = (rms_norm_reference(q, q_weight, eps, zero_centred), rms_norm_reference(k, k_weight, eps, zero_centred))
    c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, T, 1, R]
    rot = c.shape[-1]
    q, k = (torch.cat((rotate(t[..., :rot], c, s), t[..., rot:]), dim=-1) for t in (q, k))
    offsets = positions % k_cache.shape[2]
    k_cache[write_blocks, :, offsets] = k
    v_cache[write_blocks, :, offsets] = v
    return q, gate.clone() if gated else q.new_empty((B, T, heads, 0))


def silu_mul_reference(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A gate/up product (gate columns first) -> silu(gate) * up."""
    gate, up = sum_parts(parts, dtype, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm_reference(x: torch.Tensor, parts: torch.Tensor, z_col: int, weight: torch.Tensor, eps: float,
                             dtype: torch.dtype) -> torch.Tensor:
    """A Gated DeltaNet's output norm: x [B, T, Hv, D] (fp32) rounded to dtype, RMSNorm (plain weight), times SiLU(z) in
    fp32, cast back; z the product's columns from z_col."""
    x = x.to(dtype)
    z = sum_parts(parts, dtype)[..., z_col : z_col + x.shape[2] * x.shape[3]].reshape(x.shape)
    return (rms_norm_reference(x, weight, eps).float() * F.silu(z.float())).to(dtype)


def causal_conv_reference(parts: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor,
                          real: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Gated DeltaNet's causal depthwise convolution with SiLU over the product's first C columns (its inputs), from
    each row's state state[slot, read] ([slots, 2, C, K - 1]: the inputs before the block; weight [C, K], fp32; each
    output the taps summed in order in fp32) -> both [B, T, 2, C]: the inputs and the outputs. The next state (the
    K - 1 inputs before each row's first padding token) goes to state[slot, 1 - read]."""
    C, K = weight.shape
    mixed = sum_parts(parts, dtype)[..., :C]  # [B, T, C]
    T = mixed.shape[1]
    inputs = torch.cat((state[slots, reads], mixed.transpose(1, 2)), dim=2)  # [B, C, K - 1 + T]
    wide = inputs.float()
    conv = weight[:, 0, None] * wide[:, :, :T]
    for j in range(1, K):
        conv = conv + weight[:, j, None] * wide[:, :, j : j + T]
    ends = real.sum(dim=1)[:, None] + torch.arange(K - 1, device=parts.device)
    state[slots, 1 - reads] = inputs.gather(2, ends[:, None, :].expand(-1, C, -1))
    return torch.stack((mixed, F.silu(conv).to(dtype).transpose(1, 2)), dim=2)


def delta_gates_reference(parts: torch.Tensor, col_b: int, col_a: int, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The delta rule's log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b) of every
    value head, fp32 [B, T, 2, Hv] (g first), both 0 at padding (real [B, T] 0): a padding token leaves the state as it
    is. a and b: the product's Hv columns from col_a and col_b."""
    y = sum_parts(parts, dtype)
    hv = a_log.shape[0]
    a, b = y[..., col_a : col_a + hv], y[..., col_b : col_b + hv]
    mask = real[..., None].float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()) * mask
    return torch.stack((g, torch.sigmoid(b.float()) * mask), dim=2)


def split_heads(conv: torch.Tensor, key_heads: int, key_dim: int, value_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet's convolution outputs [..., C] -> q, k [..., Hk, dk], v [..., Hv, dv]."""
    kd = key_heads * key_dim
    q, k, v = conv[..., :kd], conv[..., kd : 2 * kd], conv[..., 2 * kd :]
    return (q.unflatten(-1, (key_heads, key_dim)), k.unflatten(-1, (key_heads, key_dim)),
            v.unflatten(-1, (value_heads, v.shape[-1] // value_heads)))


def delta_rule_reference(state: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                         g: torch.Tensor, beta: torch.Tensor, scale: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gated delta rule over T tokens from state [B, Hv, dk, dv] (fp32): q, k [B, T, Hk, dk] as the convolution
    left them (each key head serving Hv / Hk consecutive value heads; l2-normalised here, q also scaled; q None: no
    outputs), v [B, T, Hv, dv], g (log decay) and beta [B, T, Hv] -> the outputs [B, T, Hv, dv] and the final state
    (`delta_rule.delta_rule_steps`)."""
    groups = v.shape[2] // k.shape[2]
    k = l2_normalise(k.float().repeat_interleave(groups, dim=2))
    q = None if q is None else l2_normalise(q.float().repeat_interleave(groups, dim=2)) * scale
    return delta_rule_steps(state, k, v.float(), g.float(), beta.float(), q)


def gated_delta_rule_reference(rec: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor, both: torch.Tensor,
                               gates: torch.Tensor, key_heads: int, scale: float) -> torch.Tensor:
    """The recurrence of a Gated DeltaNet layer over a block: each row's state rec[slot, read] ([slots, 2, Hv, dk, dv],
    fp32) advanced over its tokens (q, k, v the convolution's outputs both[:, :, 1], g and beta `gates`), the final
    state written to rec[slot, 1 - read] -> the outputs [B, T, Hv, dv] (fp32)."""
    hv, dk = rec.shape[2], rec.shape[3]
    q, k, v = split_heads(both[:, :, 1], key_heads, dk, hv)
    out, state = delta_rule_reference(rec[slots, reads], q, k, v, gates[:, :, 0], gates[:, :, 1], scale)
    rec[slots, 1 - reads] = state
    return out


def rollback_reference(rec: torch.Tensor, conv: torch.Tensor, kept: torch.Tensor, kept_gates: torch.Tensor,
                       slots: torch.Tensor, current: torch.Tensor, counts: torch.Tensor, key_heads: int) -> None:
    """Every layer of R slots at once: each slot's current buffers (rec [L, slots, 2, Hv, dk, dv], conv [L, slots, 2, C,
    K - 1]) become its other buffers advanced by its first counts[r] kept tokens (kept [L, slots, W, 2, C]: the last
    forward's convolution inputs and outputs; kept_gates [L, slots, W, 2, Hv]) with the recurrence of the step; the
    tokens past a slot's count enter as padding (g = beta = 0), which leaves a state bitwise as it is."""
    L, W = rec.shape[0], kept.shape[2]
    hv, dk, dv = rec.shape[3:]
    k1 = conv.shape[-1]
    prev = 1 - current
    live = (torch.arange(W, device=rec.device)[None, :] < counts[:, None]).float()[None, :, :, None]  # [1, R, W, 1]
    gates = kept_gates[:, slots] * live[..., None]  # [L, R, W, 2, Hv]
    _, k, v = split_heads(kept[:, slots, :, 1].flatten(0, 1), key_heads, dk, hv)  # [L R, W, ...]
    _, state = delta_rule_reference(rec[:, slots, prev].flatten(0, 1), None, k, v, gates[:, :, :, 0].flatten(0, 1),
                                    gates[:, :, :, 1].flatten(0, 1), 1.0)
    rec[:, slots, current] = state.view(L, -1, hv, dk, dv)
    inputs = torch.cat((conv[:, slots, prev], kept[:, slots, :, 0].transpose(2, 3)), dim=3)  # [L, R, C, K - 1 + W]
    ends = (counts[:, None] + torch.arange(k1, device=rec.device))[None, :, None, :]  # [1, R, 1, K - 1]
    conv[:, slots, current] = inputs.gather(3, ends.expand(L, -1, inputs.shape[2], -1))


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """x [N, H]; weights, ids [N, top_k] (routing weight in x's dtype, expert id); gate_up [E, 2 I, H] (gate rows
    first), down [E, H, I] -> [N, H]: sum over rank j of weights[:, j] * down_e(silu(gate_e x) * up_e x), in rank order."""
    out = None
    for j in range(ids.shape[1]):
        gu = torch.bmm(gate_up[ids[:, j]], x[:, :, None])[..., 0]  # [N, 2 I]
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm(down[ids[:, j]], (F.silu(gate) * up)[:, :, None])[..., 0] * weights[:, j, None]  # [N, H]
        out = y if out is None else out + y
    return out
