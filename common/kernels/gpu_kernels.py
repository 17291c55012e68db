"""Batch-invariant operators of the CUDA backend: a row's result depends on that row alone.

Two torch custom operators, so that a captured or compiled step sees each as one opaque node:

* `blockspec::linear(x, w)` = x @ w.T. On CUDA a Triton GEMM whose tiles (BLOCK_M x BLOCK_N x BLOCK_K) and split of K
  are fixed by the weight's shape and the device, never by the row count: every row is reduced in the same order
  whether it is decoded alone, verified in a block of 16 or batched with 15 other requests. The split partials are
  added in a fixed order (split 0 first).
* `blockspec::cache_attention(q, k_cache, v_cache, slots, positions, scale)`: each query row attends to keys
  [0, position] of its slot, read in place from the static cache [slots, kv_heads, max_len, head_dim] (no gather, no
  mask tensor). Keys are split into fixed chunks of CHUNK positions (flash-decoding with a split fixed per position,
  not per batch), each chunk's partial softmax combined in chunk order.

* `blockspec::moe(x, weights, ids, gate_up, down)`: a mixture of experts' routed MLPs. The (token, expert) pairs are
  grouped by expert into blocks of MOE_BLOCK rows (each expert's group padded to whole blocks: a layout of static size,
  built on the device), each block's products run with that expert's weights in the GEMM's fixed order, and every
  token adds its top_k outputs in rank order.

Elsewhere (the CPU) each operator is its torch reference: F.linear, and SDPA over the gathered slots with a causal
mask. `triton_kernels.py` and `triton_deltanet.py` hold the kernels; `TRITON_INTERPRET=1` runs them on CPU tensors
(tests/common/runtime/test_cuda_runner.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from blockspec.common.kernels import triton_deltanet as td
from blockspec.common.kernels import triton_kernels as tk
from blockspec.common.kernels.delta_rule import delta_rule_steps, l2_normalise

# --- the torch references (CPU, and what the kernels are tested against) -------------------------------------------

def linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D], caches [S, KV, L, D], slots [B], positions [B, T] -> [B, T, H, D]."""
    keys, values = k_cache[slots], v_cache[slots]  # [B, KV, L, D]
    mask = (torch.arange(k_cache.shape[2], device=q.device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [B, H, T, D]
    return out.transpose(1, 2)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """transformers' arithmetic: normalise in fp32, scale in the model dtype; zero_centred (the Qwen3.5 hybrids): scale
    by 1 + weight in fp32, then cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype) if zero_centred else weight * h.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, zero_centred), summed


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Gated DeltaNet's output norm: RMSNorm (plain weight) of x, then times SiLU(gate) in fp32, cast back."""
    return (rms_norm_reference(x, weight, eps).float() * F.silu(gate.float())).to(x.dtype)


def gated_delta_rule_reference(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens from state [B, Hv, dk, dv] (fp32): q, k [B, T, Hk, dk] as the convolution
    left them (each key head serving Hv / Hk consecutive value heads; l2-normalised here, q also scaled), v [B, T, Hv,
    dv], g (log decay) and beta [B, T, Hv]. Returns the outputs [B, T, Hv, dv] and the final state
    (`delta_rule.delta_rule_steps`)."""

    groups = v.shape[2] // k.shape[2]
    q, k = (t.float().repeat_interleave(groups, dim=2) for t in (q, k))
    return delta_rule_steps(state, l2_normalise(k), v.float(), g.float(), beta.float(), l2_normalise(q) * scale)


def causal_conv_reference(state: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet's causal depthwise convolution with SiLU: state [B, C, K - 1] (the inputs before the block),
    mixed [B, T, C], weight [C, K] (fp32) -> [B, T, C] in mixed's dtype; each output the taps summed in order in fp32."""
    T, K = mixed.shape[1], weight.shape[1]
    wide = torch.cat((state, mixed.transpose(1, 2)), dim=2).float()  # [B, C, K - 1 + T]
    conv = weight[:, 0, None] * wide[:, :, :T]
    for j in range(1, K):
        conv = conv + weight[:, j, None] * wide[:, :, j : j + T]
    return F.silu(conv).to(mixed.dtype).transpose(1, 2)


def delta_gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), fp32
    [B, T, Hv], both 0 at padding (real [B, T] False): a padding token leaves the state as it is."""
    mask = real[..., None].float()
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()) * mask, torch.sigmoid(b.float()) * mask


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout: x [..., heads, D], cos / sin [..., 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def qk_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float,
                           zero_centred: bool = False) -> torch.Tensor:
    """qkv [B, T, heads + kv_heads (+ more), D] -> the q and k heads [B, T, heads + kv_heads, D], each RMS-normed with
    its weight (where the weights are not empty) and rotated at its position on its first R features (cos / sin
    tables [max_len, R]; the rest pass)."""
    q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
    if q_weight.numel():
        q, k = (rms_norm_reference(q, q_weight, eps, zero_centred), rms_norm_reference(k, k_weight, eps, zero_centred))
    c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, T, 1, R]
    qk, rot = torch.cat((q, k), dim=2), c.shape[-1]
    return torch.cat((rotate(qk[..., :rot], c, s), qk[..., rot:]), dim=-1)


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


# --- the operators --------------------------------------------------------------------------------------------------

@torch.library.custom_op("blockspec::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T -> [..., N] in x's dtype."""
    return linear_reference(x, w)


@linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@linear.register_kernel("cuda")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return tk.triton_linear(x, w)


@torch.library.custom_op("blockspec::cache_attention", mutates_args=())
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
    return attention_reference(q, k_cache, v_cache, slots, positions, scale)


@cache_attention.register_fake
def _(q, k_cache, v_cache, slots, positions, scale):
    return torch.empty_like(q)


@cache_attention.register_kernel("cuda")
def _(q, k_cache, v_cache, slots, positions, scale):
    return tk.triton_attention(q, k_cache, v_cache, slots, positions, scale)


@torch.library.custom_op("blockspec::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a layer's residual add and the next norm in one pass."""
    return add_rms_norm_reference(x, residual, weight, eps, zero_centred)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, zero_centred=False):
    return torch.empty_like(x), torch.empty_like(x)


@add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps, zero_centred=False):
    return tk.triton_add_rms_norm(x, residual, weight, eps, zero_centred)


@torch.library.custom_op("blockspec::qk_norm_rope", mutates_args=())
def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float,
                 zero_centred: bool = False) -> torch.Tensor:
    return qk_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, positions, heads, kv_heads, eps, zero_centred)


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, positions, heads, kv_heads, eps, zero_centred=False):
    return qkv.new_empty((*qkv.shape[:2], heads + kv_heads, qkv.shape[3]))


@qk_norm_rope.register_kernel("cuda")
def _(qkv, q_weight, k_weight, cos, sin, positions, heads, kv_heads, eps, zero_centred=False):
    return tk.triton_qk_norm_rope(qkv, q_weight, k_weight, cos, sin, positions, heads, kv_heads, eps, zero_centred)


@torch.library.custom_op("blockspec::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D] (a Gated DeltaNet's heads) -> rms_norm(x) * silu(gate)."""
    return gated_rms_norm_reference(x, gate, weight, eps)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x)


@gated_rms_norm.register_kernel("cuda")
def _(x, gate, weight, eps):
    return tk.triton_gated_rms_norm(x, gate, weight, eps)


@torch.library.custom_op("blockspec::gated_delta_rule", mutates_args=())
def gated_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of a Gated DeltaNet layer over a block of tokens, one token after another in a fixed order:
    `gated_delta_rule_reference`. On CUDA one program per (request, value head, 64 value columns) keeps its part of
    the state on chip for the whole block, l2-normalising q and k as it goes."""
    return gated_delta_rule_reference(state, q, k, v, g, beta, scale)


@gated_delta_rule.register_fake
def _(state, q, k, v, g, beta, scale):
    return v.new_empty(v.shape, dtype=torch.float32), torch.empty_like(state)


@gated_delta_rule.register_kernel("cuda")
def _(state, q, k, v, g, beta, scale):
    return td.triton_gated_delta_rule(state, q, k, v, g, beta, scale)


@torch.library.custom_op("blockspec::causal_conv", mutates_args=())
def causal_conv(state: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return causal_conv_reference(state, mixed, weight)


@causal_conv.register_fake
def _(state, mixed, weight):
    return torch.empty_like(mixed)


@causal_conv.register_kernel("cuda")
def _(state, mixed, weight):
    return td.triton_causal_conv(state, mixed, weight)


@torch.library.custom_op("blockspec::delta_gates", mutates_args=())
def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return delta_gates_reference(a, b, a_log, dt_bias, real)


@delta_gates.register_fake
def _(a, b, a_log, dt_bias, real):
    return a.new_empty(a.shape, dtype=torch.float32), a.new_empty(a.shape, dtype=torch.float32)


@delta_gates.register_kernel("cuda")
def _(a, b, a_log, dt_bias, real):
    return td.triton_delta_gates(a, b, a_log, dt_bias, real)


@torch.library.custom_op("blockspec::moe", mutates_args=())
def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor) -> torch.Tensor:
    return moe_reference(x, weights, ids, gate_up, down)


@moe.register_fake
def _(x, weights, ids, gate_up, down):
    return torch.empty_like(x)


@moe.register_kernel("cuda")
def _(x, weights, ids, gate_up, down):
    return tk.triton_moe(x, weights, ids, gate_up, down)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
