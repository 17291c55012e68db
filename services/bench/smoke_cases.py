"""The operator cases of `gpu-check`'s smoke stage (gpu_smoke.py), one small function per operator and shape in one
table, CASES. Each builds random inputs of MAX_ROWS rows once and calls its operator through `gpu_kernels`' public
functions only: an operator whose signature changes changes here, in its case."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.models.decoder import rope_table
from blockspec.common.models.model_config import ModelConfig

MAX_ROWS = 128  # the largest batch a row is compared in
# Largest error of an operator's bf16 output against its torch reference run in fp32 on fp32 copies of the same
# inputs, over the largest magnitude of the reference's output. One bf16 rounding is at most 2^-9 (0.2%) of a value:
# products and the convolution round once (their sums stay fp32), the norms, rotary embedding, attention (its
# probabilities meet V in bf16) and the experts (their activations) two to four times, allowed 5-10x that; the gates
# and the delta rule compute in fp32 from the same inputs and differ only in the order of their sums and their exp.
TOLERANCES = {"linear": 1e-2, "cache_attention": 2e-2, "add_rms_norm": 2e-2, "qk_norm_rope": 2e-2,
              "gated_rms_norm": 2e-2, "gated_delta_rule": 1e-3, "causal_conv": 1e-2, "delta_gates": 1e-3, "moe": 2e-2}


@dataclass(frozen=True)
class SmokeShapes:
    dense: ModelConfig  # a Qwen3-shaped target's ("27b" on a GPU)
    hybrid: ModelConfig  # a Qwen3.5 hybrid's ("27b-hybrid": Qwen3.5-27B)
    moe: ModelConfig  # a mixture's (Qwen3.6-35B-A3B: there is no 27B one)
    context: int  # KV positions each request of the attention cases holds


@dataclass(frozen=True)
class Case:
    """One operator at one shape. args(m): its arguments for the first m <= MAX_ROWS rows (requests or tokens), the
    same rows for every m. bytes(m): what it must read and write for m rows, where that is not every argument and
    output in full (None: those)."""

    operator: str  # the gpu_kernels name, and its TOLERANCES key
    shape: str  # in words, for the table
    op: Callable[..., object]
    reference: Callable[..., object]
    args: Callable[[int], tuple]
    bytes: Callable[[int], int] | None = None

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.operator]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32).mul_(scale).to(dtype)


def _gen(device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _positions(context: int, device: str) -> torch.Tensor:
    """[MAX_ROWS, 1]: each request's position, near the end of the context (one request in 16 at each)."""
    return (context - 1 - torch.arange(MAX_ROWS, device=device) % 16)[:, None]


def _linear(n: int, k: int, dtype: torch.dtype, device: str) -> Case:
    gen = _gen(device)
    x, w = _randn(gen, MAX_ROWS, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=0.02)
    return Case("linear", f"{k} -> {n}", gk.linear, gk.linear_reference, lambda m: (x[:m], w))


def linear_qkv(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    c = s.dense
    return _linear((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size, dtype, device)


def linear_gate_up(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _linear(2 * s.dense.intermediate_size, s.dense.hidden_size, dtype, device)


def linear_down(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _linear(s.dense.hidden_size, s.dense.intermediate_size, dtype, device)


def linear_in_proj(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    lin = s.hybrid.linear  # q/k/v, z, b and a of a Gated DeltaNet layer: one product
    return _linear(lin.conv_dim + lin.value_dim + 2 * lin.num_v_heads, s.hybrid.hidden_size, dtype, device)


def _attention(c: ModelConfig, context: int, dtype: torch.dtype, device: str) -> Case:
    gen, (H, KV, D) = _gen(device), (c.num_heads, c.num_kv_heads, c.head_dim)
    q = _randn(gen, MAX_ROWS, 1, H, D, dtype=dtype)
    k_cache, v_cache = (_randn(gen, MAX_ROWS, KV, context, D, dtype=dtype) for _ in range(2))  # a slot a request
    slots, positions = torch.arange(MAX_ROWS, device=device), _positions(context, device)
    scale, size = gk.attention_scale(D), dtype.itemsize

    def bytes_(m: int) -> int:  # q and the output, and each request's keys and values up to its position
        return (2 * m * H * D + int((positions[:m] + 1).sum()) * 2 * KV * D) * size

    return Case("cache_attention", f"{H} heads, {KV} KV, head_dim {D}, context {context}", gk.cache_attention,
                gk.attention_reference, lambda m: (q[:m], k_cache, v_cache, slots[:m], positions[:m], scale), bytes_)


def cache_attention(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention(s.dense, s.context, dtype, device)


def cache_attention_hybrid(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention(s.hybrid, s.context, dtype, device)


def add_rms_norm(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, c = _gen(device), s.dense
    x, residual = (_randn(gen, MAX_ROWS, c.hidden_size, dtype=dtype) for _ in range(2))
    weight = 1 + _randn(gen, c.hidden_size, dtype=dtype, scale=0.1)
    return Case("add_rms_norm", f"hidden {c.hidden_size}", gk.add_rms_norm, gk.add_rms_norm_reference,
                lambda m: (x[:m], residual[:m], weight, c.rms_norm_eps))


def add_rms_norm_zero_centred(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, c = _gen(device), s.hybrid
    x, residual = (_randn(gen, MAX_ROWS, c.hidden_size, dtype=dtype) for _ in range(2))
    weight = _randn(gen, c.hidden_size, dtype=dtype, scale=0.1)
    return Case("add_rms_norm", f"hidden {c.hidden_size}, zero-centred", gk.add_rms_norm, gk.add_rms_norm_reference,
                lambda m: (x[:m], residual[:m], weight, c.rms_norm_eps, True))


def _qk_norm_rope(c: ModelConfig, heads: int, context: int, dtype: torch.dtype, device: str,
                  zero_centred: bool) -> Case:
    gen, (H, KV, D) = _gen(device), (c.num_heads, c.num_kv_heads, c.head_dim)
    qkv = _randn(gen, MAX_ROWS, 1, heads, D, dtype=dtype)
    q_w, k_w = ((0 if zero_centred else 1) + _randn(gen, D, dtype=dtype, scale=0.1) for _ in range(2))
    cos, sin = (t.to(device, dtype) for t in rope_table(c, context))
    positions = _positions(context, device)

    def bytes_(m: int) -> int:  # the q and k heads read and written, a cos and a sin row each
        return (2 * m * (H + KV) * D + 2 * m * cos.shape[1]) * dtype.itemsize

    return Case("qk_norm_rope", f"{H} + {KV} heads of {D}, rotary {cos.shape[1]}", gk.qk_norm_rope,
                gk.qk_norm_rope_reference,
                lambda m: (qkv[:m], q_w, k_w, cos, sin, positions[:m], H, KV, c.rms_norm_eps, zero_centred), bytes_)


def qk_norm_rope(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    c = s.dense  # the dense step's q, k and v heads
    return _qk_norm_rope(c, c.num_heads + 2 * c.num_kv_heads, s.context, dtype, device, False)


def qk_norm_rope_hybrid(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    c = s.hybrid  # the hybrid step's q and k heads (its gate and v apart)
    return _qk_norm_rope(c, c.num_heads + c.num_kv_heads, s.context, dtype, device, True)


def gated_rms_norm(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    x, gate = (_randn(gen, MAX_ROWS, 1, lin.num_v_heads, lin.v_head_dim, dtype=dtype) for _ in range(2))
    weight = 1 + _randn(gen, lin.v_head_dim, dtype=dtype, scale=0.1)
    return Case("gated_rms_norm", f"{lin.num_v_heads} heads of {lin.v_head_dim}", gk.gated_rms_norm,
                gk.gated_rms_norm_reference, lambda m: (x[:m], gate[:m], weight, s.hybrid.rms_norm_eps))


def _delta_rule(s: SmokeShapes, tokens: int, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    Hk, Hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim
    state = _randn(gen, MAX_ROWS, Hv, dk, dv, dtype=torch.float32, scale=0.1)
    q, k = (_randn(gen, MAX_ROWS, tokens, Hk, dk, dtype=dtype) for _ in range(2))
    v = _randn(gen, MAX_ROWS, tokens, Hv, dv, dtype=dtype)
    g = -torch.rand((MAX_ROWS, tokens, Hv), generator=gen, device=device)  # log decay
    beta = torch.rand((MAX_ROWS, tokens, Hv), generator=gen, device=device)
    return Case("gated_delta_rule", f"{Hk} key, {Hv} value heads of {dk} x {dv}, {tokens} token(s)",
                gk.gated_delta_rule, gk.gated_delta_rule_reference,
                lambda m: (state[:m], q[:m], k[:m], v[:m], g[:m], beta[:m], dk ** -0.5))


def gated_delta_rule(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _delta_rule(s, 1, dtype, device)


def gated_delta_rule_block(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _delta_rule(s, 16, dtype, device)


def causal_conv(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    C, K = lin.conv_dim, lin.conv_kernel
    state = _randn(gen, MAX_ROWS, C, K - 1, dtype=dtype)
    mixed = _randn(gen, MAX_ROWS, 1, C, dtype=dtype)
    weight = _randn(gen, C, K, dtype=torch.float32, scale=0.5)
    return Case("causal_conv", f"{C} channels, kernel {K}", gk.causal_conv, gk.causal_conv_reference,
                lambda m: (state[:m], mixed[:m], weight))


def delta_gates(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, Hv = _gen(device), s.hybrid.linear.num_v_heads
    a, b = (_randn(gen, MAX_ROWS, 1, Hv, dtype=dtype) for _ in range(2))
    a_log, dt_bias = (_randn(gen, Hv, dtype=dtype, scale=0.5) for _ in range(2))
    real = torch.ones((MAX_ROWS, 1), dtype=torch.bool, device=device)
    return Case("delta_gates", f"{Hv} value heads", gk.delta_gates, gk.delta_gates_reference,
                lambda m: (a[:m], b[:m], a_log, dt_bias, real[:m]))


def moe(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, e = _gen(device), s.moe.experts
    E, H, I = e.num_experts, s.moe.hidden_size, e.intermediate_size
    x = _randn(gen, MAX_ROWS, H, dtype=dtype)
    gate_up, down = _randn(gen, E, 2 * I, H, dtype=dtype, scale=0.02), _randn(gen, E, H, I, dtype=dtype, scale=0.02)
    ids = torch.rand((MAX_ROWS, E), generator=gen, device=device).topk(e.top_k, dim=-1).indices  # distinct experts
    weights = torch.rand((MAX_ROWS, e.top_k), generator=gen, device=device).softmax(-1).to(dtype)

    def bytes_(m: int) -> int:  # the experts the m tokens reach, their inputs and outputs
        return (len(ids[:m].unique()) * 3 * I * H + 2 * m * H) * dtype.itemsize

    return Case("moe", f"{E} experts, top {e.top_k}, hidden {H}, intermediate {I}", gk.moe, gk.moe_reference,
                lambda m: (x[:m], weights[:m], ids[:m], gate_up, down), bytes_)


# name -> case, in the order the smoke runs them (the most telling first: a smoke past its time leaves out the last)
CASES: dict[str, Callable[[SmokeShapes, torch.dtype, str], Case]] = {
    "cache_attention": cache_attention,
    "cache_attention (hybrid)": cache_attention_hybrid,
    "gated_delta_rule": gated_delta_rule,
    "gated_delta_rule (16 tokens)": gated_delta_rule_block,
    "add_rms_norm": add_rms_norm,
    "add_rms_norm (zero-centred)": add_rms_norm_zero_centred,
    "qk_norm_rope": qk_norm_rope,
    "qk_norm_rope (hybrid)": qk_norm_rope_hybrid,
    "gated_rms_norm": gated_rms_norm,
    "causal_conv": causal_conv,
    "delta_gates": delta_gates,
    "linear qkv": linear_qkv,
    "linear gate_up": linear_gate_up,
    "linear down": linear_down,
    "linear in_proj (hybrid)": linear_in_proj,
    "moe": moe,
}
