"""The operator cases of `gpu-check`'s smoke stage (gpu_smoke.py), one small function per operator and shape in one
table, CASES. Each builds random inputs of MAX_ROWS rows once and calls its operator through `gpu_kernels`' public
functions only: an operator whose signature changes changes here, in its case."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.kernels import references as kr
from blockspec.common.models.decoder import rope_table
from blockspec.common.models.model_config import ModelConfig

MAX_ROWS = 128  # the largest batch a row is compared in
BLOCK = 16  # KV cache positions per block (the CUDA runner's default)
# Largest error of an operator's bf16 output against its torch reference run in fp32 on fp32 copies of the same
# inputs, over the largest magnitude of the reference's output. One bf16 rounding is at most 2^-9 (0.2%) of a value:
# products and the convolution round once (their sums stay fp32), the norms, rotary embedding, attention (its
# probabilities meet V in bf16) and the experts (their activations) two to four times, allowed 5-10x that; the gates
# and the delta rule compute in fp32 from the same inputs and differ only in the order of their sums and their exp.
TOLERANCES = {"linear": 1e-2, "cache_attention": 2e-2, "add_rms_norm": 2e-2, "attention_inputs": 2e-2,
              "silu_mul": 2e-2, "gated_rms_norm": 2e-2, "gated_delta_rule": 1e-3, "causal_conv": 1e-2,
              "delta_gates": 1e-3, "moe": 2e-2}


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
    return Case("linear", f"{k} -> {n}", gk.linear, kr.linear_reference, lambda m: (x[:m], w))


def _parts(gen: torch.Generator, n: int, k: int, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    """The split partials of a product [MAX_ROWS, 1, k] @ [n, k].T as the step's products leave them (`linear_parts`);
    m -> those of the first m rows."""
    parts = gk.linear_parts(_randn(gen, MAX_ROWS, 1, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=0.05))
    return lambda m: parts[:, :m].contiguous()


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


def _attention(c: ModelConfig, context: int, dtype: torch.dtype, device: str, gated: bool) -> Case:
    gen, (H, KV, D) = _gen(device), (c.num_heads, c.num_kv_heads, c.head_dim)
    q, gate = (_randn(gen, MAX_ROWS, 1, H, D, dtype=dtype) for _ in range(2))
    blocks = context // BLOCK  # each request's own blocks, in blocks of BLOCK positions, read through its table
    k_cache, v_cache = (_randn(gen, MAX_ROWS * blocks, KV, BLOCK, D, dtype=dtype) for _ in range(2))
    tables, positions = torch.arange(MAX_ROWS * blocks, device=device).view(MAX_ROWS, blocks), _positions(context, device)
    scale, size = gk.attention_scale(D), dtype.itemsize

    def bytes_(m: int) -> int:  # q and the output, and each request's keys and values up to its position
        return ((2 + gated) * m * H * D + int((positions[:m] + 1).sum()) * 2 * KV * D) * size

    return Case("cache_attention", f"{H} heads, {KV} KV, head_dim {D}, context {context}{', gated' if gated else ''}",
                gk.cache_attention, kr.attention_reference,
                lambda m: (q[:m], k_cache, v_cache, tables[:m], positions[:m], scale, gate[:m] if gated else None),
                bytes_)


def cache_attention(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention(s.dense, s.context, dtype, device, False)


def cache_attention_hybrid(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention(s.hybrid, s.context, dtype, device, True)


def _add_rms_norm(c: ModelConfig, dtype: torch.dtype, device: str, zero_centred: bool) -> Case:
    gen = _gen(device)
    parts = _parts(gen, c.hidden_size, c.num_heads * c.head_dim, dtype)  # the attention's output product
    residual = _randn(gen, MAX_ROWS, 1, c.hidden_size, dtype=dtype)
    weight = (0 if zero_centred else 1) + _randn(gen, c.hidden_size, dtype=dtype, scale=0.1)
    return Case("add_rms_norm", f"hidden {c.hidden_size}{', zero-centred' if zero_centred else ''}", gk.add_rms_norm,
                kr.add_rms_norm_reference,
                lambda m: (parts(m), None, residual[:m], weight, c.rms_norm_eps, zero_centred))


def add_rms_norm(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _add_rms_norm(s.dense, dtype, device, False)


def add_rms_norm_zero_centred(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _add_rms_norm(s.hybrid, dtype, device, True)


def _attention_inputs(c: ModelConfig, context: int, dtype: torch.dtype, device: str, gated: bool) -> Case:
    """q/k norm and rotary over a q/k/v product, K and V stored (each request in a block of its own)."""
    gen, (H, KV, D) = _gen(device), (c.num_heads, c.num_kv_heads, c.head_dim)
    parts = _parts(gen, H * D * (2 if gated else 1) + 2 * KV * D, c.hidden_size, dtype)
    q_w, k_w = ((0 if gated else 1) + _randn(gen, D, dtype=dtype, scale=0.1) for _ in range(2))
    cos, sin = (t.to(device, dtype) for t in rope_table(c, context))
    positions = _positions(context, device)
    blocks = torch.arange(MAX_ROWS, device=device)[:, None]
    k_cache, v_cache = (torch.zeros(MAX_ROWS, KV, BLOCK, D, dtype=dtype, device=device) for _ in range(2))

    def bytes_(m: int) -> int:  # the product's partials read, q (and its gate) and k, v written, a cos and a sin row
        read = parts(m).numel() * parts(m).element_size()
        return read + ((1 + gated) * m * H * D + 2 * m * KV * D + 2 * m * cos.shape[1]) * dtype.itemsize

    return Case("attention_inputs", f"{H} + {KV} heads of {D}, rotary {cos.shape[1]}{', gated' if gated else ''}",
                gk.attention_inputs, kr.attention_inputs_reference,
                lambda m: (parts(m), None, q_w, k_w, cos, sin, positions[:m], blocks[:m], k_cache, v_cache, H, KV,
                           c.rms_norm_eps, gated, gated), bytes_)


def attention_inputs(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention_inputs(s.dense, s.context, dtype, device, False)


def attention_inputs_hybrid(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _attention_inputs(s.hybrid, s.context, dtype, device, True)


def silu_mul(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    c = s.dense
    parts = _parts(_gen(device), 2 * c.intermediate_size, c.hidden_size, dtype)
    return Case("silu_mul", f"intermediate {c.intermediate_size}", gk.silu_mul, kr.silu_mul_reference,
                lambda m: (parts(m), None, dtype))


def _deltanet_parts(s: SmokeShapes, gen: torch.Generator, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    lin = s.hybrid.linear  # the layer's one input product: q/k/v, z, b, a
    return _parts(gen, lin.conv_dim + lin.value_dim + 2 * lin.num_v_heads, s.hybrid.hidden_size, dtype)


def gated_rms_norm(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    x = _randn(gen, MAX_ROWS, 1, lin.num_v_heads, lin.v_head_dim, dtype=torch.float32)
    parts = _deltanet_parts(s, gen, dtype)
    weight = 1 + _randn(gen, lin.v_head_dim, dtype=dtype, scale=0.1)
    return Case("gated_rms_norm", f"{lin.num_v_heads} heads of {lin.v_head_dim}", gk.gated_rms_norm,
                kr.gated_rms_norm_reference,
                lambda m: (x[:m], parts(m), lin.conv_dim, weight, s.hybrid.rms_norm_eps, dtype))


def _delta_rule(s: SmokeShapes, tokens: int, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    Hk, Hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim
    rec = _randn(gen, MAX_ROWS, 2, Hv, dk, dv, dtype=torch.float32, scale=0.1)  # [slots, 2 buffers, ...]
    both = _randn(gen, MAX_ROWS, tokens, 2, lin.conv_dim, dtype=dtype)  # the convolution's inputs and outputs
    g = -torch.rand((MAX_ROWS, tokens, 1, Hv), generator=gen, device=device)  # log decay
    beta = torch.rand((MAX_ROWS, tokens, 1, Hv), generator=gen, device=device)
    gates = torch.cat((g, beta), dim=2)
    slots, reads = torch.arange(MAX_ROWS, device=device), torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
    return Case("gated_delta_rule", f"{Hk} key, {Hv} value heads of {dk} x {dv}, {tokens} token(s)",
                gk.gated_delta_rule, kr.gated_delta_rule_reference,
                lambda m: (rec, slots[:m], reads[:m], both[:m], gates[:m], Hk, dk ** -0.5))


def gated_delta_rule(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _delta_rule(s, 1, dtype, device)


def gated_delta_rule_block(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    return _delta_rule(s, 16, dtype, device)


def causal_conv(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    C, K = lin.conv_dim, lin.conv_kernel
    parts = _deltanet_parts(s, gen, dtype)
    state = _randn(gen, MAX_ROWS, 2, C, K - 1, dtype=dtype)
    weight = _randn(gen, C, K, dtype=torch.float32, scale=0.5)
    slots, reads = torch.arange(MAX_ROWS, device=device), torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
    real = torch.ones((MAX_ROWS, 1), dtype=torch.long, device=device)
    return Case("causal_conv", f"{C} channels, kernel {K}", gk.causal_conv, kr.causal_conv_reference,
                lambda m: (parts(m), state, slots[:m], reads[:m], real[:m], weight, dtype))


def delta_gates(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, lin = _gen(device), s.hybrid.linear
    Hv = lin.num_v_heads
    parts = _deltanet_parts(s, gen, dtype)
    a_log, dt_bias = (_randn(gen, Hv, dtype=dtype, scale=0.5) for _ in range(2))
    real = torch.ones((MAX_ROWS, 1), dtype=torch.long, device=device)
    b_col = lin.conv_dim + lin.value_dim
    return Case("delta_gates", f"{Hv} value heads", gk.delta_gates, kr.delta_gates_reference,
                lambda m: (parts(m), b_col, b_col + Hv, a_log, dt_bias, real[:m], dtype))


def moe(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
    gen, e = _gen(device), s.moe.experts
    E, H, I = e.num_experts, s.moe.hidden_size, e.intermediate_size
    x = _randn(gen, MAX_ROWS, H, dtype=dtype)
    gate_up, down = _randn(gen, E, 2 * I, H, dtype=dtype, scale=0.02), _randn(gen, E, H, I, dtype=dtype, scale=0.02)
    ids = torch.rand((MAX_ROWS, E), generator=gen, device=device).topk(e.top_k, dim=-1).indices  # distinct experts
    weights = torch.rand((MAX_ROWS, e.top_k), generator=gen, device=device).softmax(-1).to(dtype)

    def bytes_(m: int) -> int:  # the experts the m tokens reach, their inputs and outputs
        return (len(ids[:m].unique()) * 3 * I * H + 2 * m * H) * dtype.itemsize

    return Case("moe", f"{E} experts, top {e.top_k}, hidden {H}, intermediate {I}", gk.moe, kr.moe_reference,
                lambda m: (x[:m], weights[:m], ids[:m], gate_up, down), bytes_)


# name -> case, in the order the smoke runs them (the most telling first: a smoke past its time leaves out the last)
CASES: dict[str, Callable[[SmokeShapes, torch.dtype, str], Case]] = {
    "cache_attention": cache_attention,
    "cache_attention (hybrid)": cache_attention_hybrid,
    "gated_delta_rule": gated_delta_rule,
    "gated_delta_rule (16 tokens)": gated_delta_rule_block,
    "add_rms_norm": add_rms_norm,
    "add_rms_norm (zero-centred)": add_rms_norm_zero_centred,
    "attention_inputs": attention_inputs,
    "attention_inputs (hybrid)": attention_inputs_hybrid,
    "silu_mul": silu_mul,
    "gated_rms_norm": gated_rms_norm,
    "causal_conv": causal_conv,
    "delta_gates": delta_gates,
    "linear qkv": linear_qkv,
    "linear gate_up": linear_gate_up,
    "linear down": linear_down,
    "linear in_proj (hybrid)": linear_in_proj,
    "moe": moe,
}
