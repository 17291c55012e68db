"""The Qwen3.5 hybrid decoder: Gated DeltaNet linear-attention layers and gated full-attention layers, under the HF
names, over a slot KV cache (attention layers) and slot states (linear layers, `state_cache.py`).

Semantics follow the published models (transformers' `qwen3_5`): RMSNorm weights are zero-centred (scale 1 + w,
computed in fp32); attention applies RoPE to the first `rotary_dim` of each head and multiplies its output by
sigmoid(gate), the gate made by q_proj beside the queries; a linear layer runs a causal depthwise convolution (SiLU)
over q, k, v, l2-normalises q and k, and runs the gated delta rule with decay exp(-exp(A_log) softplus(a + dt_bias))
and write strength sigmoid(b), then an RMSNorm gated by SiLU(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.common.kernels.cpu_kernels import Linear, cached_attention
from blockspec.common.kernels.delta_rule import delta_rule_prefill, delta_rule_steps, l2_normalise
from blockspec.common.models.decoder import AttentionBatch, Decoder, final_norm, mlp_of
from blockspec.common.models.model_config import ModelConfig
from blockspec.common.models.state_cache import StateStep


def zero_centred_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaling by 1 + weight, in fp32, cast back at the end (the published models' arithmetic)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight) of the delta rule's output, then times SiLU(gate) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] features of each head, the rest passed through. x [B, heads, T, hd]."""
    rot, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
    half = rot.shape[-1] // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_layer: int) -> None:
        super().__init__()
        self.cfg, self.cache_layer = cfg, cache_layer  # cache_layer: its index among the attention layers
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, 2 * H * hd, bias=False)  # per head: hd queries, then hd gates
        self.k_proj = Linear(cfg.hidden_size, KV * hd, bias=False)
        self.v_proj = Linear(cfg.hidden_size, KV * hd, bias=False)
        self.o_proj = Linear(H * hd, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_layer
        B, T, _ = x.shape
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, gate = self.q_proj(x).view(B, T, H, 2 * hd).chunk(2, dim=-1)  # each [B, T, H, hd]
        q = apply_partial_rope(self.q_norm(q).transpose(1, 2), batch.cos, batch.sin)  # [B, H, T, hd]
        k = apply_partial_rope(self.k_norm(self.k_proj(x).view(B, T, KV, hd)).transpose(1, 2), batch.cos, batch.sin)
        batch.write(layer, k, self.v_proj(x).view(B, T, KV, hd).transpose(1, 2))
        if batch.in_place:  # short queries on the CPU: one C++ call over the cache as it lies -> [B, T, H * hd]
            out = cached_attention(q, batch.cache.k[layer], batch.cache.v[layer], batch.tables, batch.positions,
                                  batch.cache.block_shift)
        else:
            keys, values = batch.read(layer)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
            out = out.transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, T, H * hd)))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, state_layer: int) -> None:
        super().__init__()
        lin = cfg.linear
        self.cfg, self.lin, self.state_layer = cfg, lin, state_layer  # state_layer: its index among linear layers
        self.in_proj_qkv = Linear(cfg.hidden_size, lin.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, lin.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, lin.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, lin.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_v_heads))
        self.norm = GatedRMSNorm(lin.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(lin.value_dim, cfg.hidden_size, bias=False)

    def _convolve(self, mixed: torch.Tensor, step: StateStep) -> tuple[torch.Tensor, torch.Tensor]:
        """mixed [B, T, conv_dim] after the slot's last conv_kernel - 1 inputs -> SiLU(conv) [B, T, conv_dim] and
        each row's new convolution state (the inputs before its first padding token) [B, conv_dim, kernel - 1]."""
        T, k1 = mixed.shape[1], self.lin.conv_kernel - 1
        inputs = torch.cat((step.conv_state(self.state_layer), mixed.transpose(1, 2)), dim=2)  # [B, C, k1 + T]
        out = F.silu(F.conv1d(inputs.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=inputs.shape[1]))
        if min(step.lengths) == T:
            state = inputs[:, :, T:]
        else:
            ends = torch.tensor(step.lengths, device=mixed.device)[:, None] + torch.arange(k1, device=mixed.device)
            state = inputs.gather(2, ends[:, None, :].expand(-1, inputs.shape[1], -1))
        return out.to(mixed.dtype).transpose(1, 2), state

    def forward(self, x: torch.Tensor, step: StateStep, real: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, H] (normed); real [B, T] bool, None when every token is real."""
        lin = self.lin
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, conv_dim]
        conv, conv_state = self._convolve(mixed, step)
        kd = lin.num_k_heads * lin.k_head_dim
        q, k, v = conv.split((kd, kd, lin.value_dim), dim=-1)
        groups = lin.num_v_heads // lin.num_k_heads  # each q/k head serves this many consecutive value heads
        q, k = (t.reshape(B, T, lin.num_k_heads, lin.k_head_dim).repeat_interleave(groups, dim=2).float()
                for t in (q, k))
        q = l2_normalise(q) / (lin.k_head_dim ** 0.5)  # [B, T, Hv, dk]
        k = l2_normalise(k)
        v = v.reshape(B, T, lin.num_v_heads, lin.v_head_dim).float()
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if real is not None:  # padding leaves the state as it is
            beta, g = beta * real[..., None], g * real[..., None]
        keep = (torch.empty(B, T, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim, device=x.device)
                if step.keep else None)
        if any(step.chunked):  # a prompt's whole blocks (never a verify block: at most 17 tokens)
            out, state = delta_rule_prefill(step.recurrent_state(self.state_layer), k, v, g, beta, q, step.chunked)
        else:
            out, state = delta_rule_steps(step.recurrent_state(self.state_layer), k, v, g, beta, q, keep)
        step.store(self.state_layer, conv_state, state, mixed, (keep,) if keep is not None else (k, v, g, beta))
        z = self.in_proj_z(x).view(B, T, lin.num_v_heads, lin.v_head_dim)
        out = self.norm(out.to(x.dtype), z)  # [B, T, Hv, dv]
        return self.out_proj(out.reshape(B, T, lin.value_dim))


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.linear = cfg.layer_type(layer) == "linear_attention"
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer))
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer))
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_of(cfg, layer)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, step: StateStep, real: torch.Tensor | None
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, step, real) if self.linear else self.self_attn(h, batch))
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoder(Decoder):
    """`decoder.Decoder` with hybrid layers and zero-centred norms, run in torch (the C++ decode path is for dense
    layers); the forward needs the batch's `states` (a `StateStep`)."""

    layer_class = HybridLayer
    norm_class = ZeroCentredRMSNorm

    def forward(self, tokens: torch.Tensor, batch: AttentionBatch, tap_layers: tuple[int, ...] = (),
                tap_dest: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        step: StateStep = batch.states
        real = None if batch.all_real else batch.real
        x = self.embed_tokens(tokens)  # [B, T, H]
        taps = []
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, step, real)
            if i in tap_layers:
                taps.append(x)
        step.finish()
        return final_norm(self.norm, x, taps, len(self.layers) in tap_layers)

    def _row_weights(self) -> None:
        return None  # no C++ decode: `logits` takes the LM head in torch
