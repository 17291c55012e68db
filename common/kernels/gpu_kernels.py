"""Batch-invariant operators of the CUDA backend: a row's result depends on that row alone.

Torch custom operators, so that a captured or compiled step sees each as one opaque node:

* `blockspec::linear_parts(x, w)`: x @ w.T as split partials. On CUDA a Triton GEMM whose tiles (BLOCK_M x BLOCK_N x
  BLOCK_K) and split of K are fixed by the weight's shape and the device, never by the row count: every row is reduced
  in the same order whether it is decoded alone, verified in a block of 16 or batched with 15 other requests. The
  operator after it adds the partials in a fixed order (split 0 first, `sum_parts`), so a product costs one launch.
  `blockspec::linear(x, w)` is the product itself (the partials added by their own launch).
* `blockspec::attention_inputs`: q/k RMS norm and rotary over a q/k/v product, storing K and V in the paged cache
  at each token's (block, offset); `blockspec::cache_attention(q, k_cache, v_cache, tables, positions, scale, gate)`:
  each query row attends to keys [0, position], read in place from the cache's blocks [blocks, kv_heads, block_len,
  head_dim] through its block table (no gather, no mask tensor). Keys are split into whole chunks
  (`triton_kernels.attention_split`: flash-decoding with a split fixed by the row's own position, not the batch or
  max_len), each split's partial softmax combined in split order.
* `add_rms_norm`, `silu_mul`, `gated_rms_norm`: per-row kernels over a product's partials.
* A Gated DeltaNet layer: `causal_conv` (and the next convolution state), `delta_gates`, `gated_delta_rule` (the
  recurrence, the slot states read and written in place) and `rollback_states` (every layer of every slot rolled
  back in one launch).
* `blockspec::moe(x, weights, ids, gate_up, down)`: a mixture of experts' routed MLPs. The (token, expert) pairs are
  grouped by expert into blocks of MOE_BLOCK rows (each expert's group padded to whole blocks: a layout of static size,
  built on the device), each block's products run with that expert's weights in the GEMM's fixed order, and every
  token adds its top_k outputs in rank order.

Elsewhere (the CPU) each operator is its torch reference (`references.py`: F.linear, SDPA over the gathered blocks with a
causal mask, the delta rule token by token). `triton_kernels.py`, `triton_rows.py` and `triton_deltanet.py` hold the kernels;
`TRITON_INTERPRET=1` runs them on CPU tensors (tests/common/runtime/test_cuda_runner.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from blockspec.common.kernels import triton_deltanet as td
from blockspec.common.kernels import triton_kernels as tk
from blockspec.common.kernels import triton_rows as tr
from blockspec.common.kernels.references import (
    add_rms_norm_reference,
    attention_inputs_reference,
    attention_reference,
    causal_conv_reference,
    delta_gates_reference,
    gated_delta_rule_reference,
    gated_rms_norm_reference,
    linear_reference,
    moe_reference,
    rollback_reference,
    silu_mul_reference,
)

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
    return F.linear(x, w) if GEMM.cublas else tk.triton_linear(x, w)


@torch.library.custom_op("blockspec::linear_parts", mutates_args=())
def linear_parts(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T as split partials [S, ..., N] (fp32; S = 1: the product in x's dtype), which the next
    operator adds in split order (`sum_parts`): no launch of its own for the sum. On the CPU S = 1."""
    return linear_reference(x, w)[None]


@linear_parts.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda" or GEMM.cublas:
        return x.new_empty((1, *x.shape[:-1], w.shape[0]))
    split = tk.gemm_config(w.shape[0], w.shape[1], tk._sms(x.device))[2]
    return x.new_empty((split, *x.shape[:-1], w.shape[0]), dtype=x.dtype if split == 1 else torch.float32)


@linear_parts.register_kernel("cuda")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)[None] if GEMM.cublas else tk.triton_linear_parts(x, w)


@torch.library.custom_op("blockspec::cache_attention", mutates_args=())
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    return attention_reference(q, k_cache, v_cache, tables, positions, scale, gate)


@cache_attention.register_fake
def _(q, k_cache, v_cache, tables, positions, scale, gate=None):
    return torch.empty_like(q)


@cache_attention.register_kernel("cuda")
def _(q, k_cache, v_cache, tables, positions, scale, gate=None):
    return tk.triton_attention(q, k_cache, v_cache, tables, positions, scale, gate)


@torch.library.custom_op("blockspec::add_rms_norm", mutates_args=())
def add_rms_norm(parts: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), x the product `parts` (+ bias): the partials' sum, a layer's residual
    add and the next norm in one pass."""
    return add_rms_norm_reference(parts, bias, residual, weight, eps, zero_centred)


@add_rms_norm.register_fake
def _(parts, bias, residual, weight, eps, zero_centred=False):
    return torch.empty_like(residual), torch.empty_like(residual)


@add_rms_norm.register_kernel("cuda")
def _(parts, bias, residual, weight, eps, zero_centred=False):
    return tr.triton_add_rms_norm(parts, bias, residual, weight, eps, zero_centred)


@torch.library.custom_op("blockspec::attention_inputs", mutates_args=("k_cache", "v_cache"))
def attention_inputs(parts: torch.Tensor, bias: torch.Tensor | None, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, write_blocks: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, eps: float,
                     zero_centred: bool = False, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_inputs_reference(parts, bias, q_weight, k_weight, cos, sin, positions, write_blocks, k_cache,
                                      v_cache, heads, kv_heads, eps, zero_centred, gated)


@attention_inputs.register_fake
def _(parts, bias, q_weight, k_weight, cos, sin, positions, write_blocks, k_cache, v_cache, heads, kv_heads, eps,
      zero_centred=False, gated=False):
    q = k_cache.new_empty((*parts.shape[1:3], heads, k_cache.shape[-1]))
    return q, q.new_empty((*q.shape[:3], q.shape[3] if gated else 0))


@attention_inputs.register_kernel("cuda")
def _(parts, bias, q_weight, k_weight, cos, sin, positions, write_blocks, k_cache, v_cache, heads, kv_heads, eps,
      zero_centred=False, gated=False):
    return tr.triton_attention_inputs(parts, bias, q_weight, k_weight, cos, sin, positions, write_blocks, k_cache,
                                      v_cache, heads, kv_heads, eps, zero_centred, gated)


@torch.library.custom_op("blockspec::silu_mul", mutates_args=())
def silu_mul(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return silu_mul_reference(parts, bias, dtype)


@silu_mul.register_fake
def _(parts, bias, dtype):
    return parts.new_empty((*parts.shape[1:-1], parts.shape[-1] // 2), dtype=dtype)


@silu_mul.register_kernel("cuda")
def _(parts, bias, dtype):
    return tr.triton_silu_mul(parts, bias, dtype)


@torch.library.custom_op("blockspec::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, parts: torch.Tensor, z_col: int, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    return gated_rms_norm_reference(x, parts, z_col, weight, eps, dtype)


@gated_rms_norm.register_fake
def _(x, parts, z_col, weight, eps, dtype):
    return torch.empty_like(x, dtype=dtype)


@gated_rms_norm.register_kernel("cuda")
def _(x, parts, z_col, weight, eps, dtype):
    return tr.triton_gated_rms_norm(x, parts, z_col, weight, eps, dtype)


@torch.library.custom_op("blockspec::causal_conv", mutates_args=("state",))
def causal_conv(parts: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor,
                real: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return causal_conv_reference(parts, state, slots, reads, real, weight, dtype)


@causal_conv.register_fake
def _(parts, state, slots, reads, real, weight, dtype):
    return parts.new_empty((*parts.shape[1:3], 2, weight.shape[0]), dtype=dtype)


@causal_conv.register_kernel("cuda")
def _(parts, state, slots, reads, real, weight, dtype):
    return td.triton_causal_conv(parts, state, slots, reads, real, weight, dtype)


@torch.library.custom_op("blockspec::delta_gates", mutates_args=())
def delta_gates(parts: torch.Tensor, col_b: int, col_a: int, a_log: torch.Tensor, dt_bias: torch.Tensor,
                real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return delta_gates_reference(parts, col_b, col_a, a_log, dt_bias, real, dtype)


@delta_gates.register_fake
def _(parts, col_b, col_a, a_log, dt_bias, real, dtype):
    return parts.new_empty((*parts.shape[1:3], 2, a_log.shape[0]), dtype=torch.float32)


@delta_gates.register_kernel("cuda")
def _(parts, col_b, col_a, a_log, dt_bias, real, dtype):
    return td.triton_delta_gates(parts, col_b, col_a, a_log, dt_bias, real, dtype)


@torch.library.custom_op("blockspec::gated_delta_rule", mutates_args=("rec",))
def gated_delta_rule(rec: torch.Tensor, slots: torch.Tensor, reads: torch.Tensor, both: torch.Tensor,
                     gates: torch.Tensor, key_heads: int, scale: float) -> torch.Tensor:
    """The recurrence of a Gated DeltaNet layer over a block of tokens, one token after another in a fixed order:
    `gated_delta_rule_reference`. On CUDA one launch for any number of tokens: one program per (request, value head, 64
    value columns) keeps its part of the state on chip for the whole block, l2-normalising q and k as it goes."""
    return gated_delta_rule_reference(rec, slots, reads, both, gates, key_heads, scale)


@gated_delta_rule.register_fake
def _(rec, slots, reads, both, gates, key_heads, scale):
    return both.new_empty((*both.shape[:2], rec.shape[2], rec.shape[4]), dtype=torch.float32)


@gated_delta_rule.register_kernel("cuda")
def _(rec, slots, reads, both, gates, key_heads, scale):
    return td.triton_gated_delta_rule(rec, slots, reads, both, gates, key_heads, scale)


@torch.library.custom_op("blockspec::rollback_states", mutates_args=("rec", "conv"))
def rollback_states(rec: torch.Tensor, conv: torch.Tensor, kept: torch.Tensor, kept_gates: torch.Tensor,
                    slots: torch.Tensor, current: torch.Tensor, counts: torch.Tensor, key_heads: int) -> None:
    """`rollback_reference`: on CUDA one launch for every layer of every slot rolled back."""
    rollback_reference(rec, conv, kept, kept_gates, slots, current, counts, key_heads)


@rollback_states.register_fake
def _(rec, conv, kept, kept_gates, slots, current, counts, key_heads):
    return None


@rollback_states.register_kernel("cuda")
def _(rec, conv, kept, kept_gates, slots, current, counts, key_heads):
    td.triton_rollback(rec, conv, kept, kept_gates, slots, current, counts, key_heads)


class _Gemm:
    """Which products `linear` and `linear_parts` run on CUDA: the Triton GEMM (cublas False), or torch's (cuBLAS)
    where a probe on the device found them row-invariant (`use_cublas`)."""

    cublas = False


GEMM = _Gemm()


def use_cublas(on: bool) -> None:
    GEMM.cublas = on


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
