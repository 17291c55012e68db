"""The MLPs of a decoder layer, under the HF names: the SiLU-gated MLP, and the mixture of experts of Qwen3-MoE and
Qwen3.5-MoE (`mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`).

Each token goes to its top_k experts by the router's softmax (in fp32; the top_k weights renormalised to sum 1 where
the config says so, then cast to the model dtype) and gets their outputs' weighted sum; Qwen3.5 adds a shared expert
scaled by sigmoid(shared_expert_gate(x)). On the CPU the experts a batch routes to run one after another over the
rows routed to each (the GPU's grouped products are elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.common.kernels import cpu_kernels
from blockspec.common.kernels.cpu_kernels import Linear, fused_linear
from blockspec.common.models.model_config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width, bias = intermediate_size or cfg.intermediate_size, cfg.mlp_bias and intermediate_size is None
        self.gate_proj = Linear(cfg.hidden_size, width, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, width, bias=bias)
        self.down_proj = Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_kernels.silu_mul(fused_linear(x, (self.gate_proj, self.up_proj))))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.experts
        self.top_k, self.norm_topk_prob = e.top_k, e.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, e.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg, e.intermediate_size) for _ in range(e.num_experts))
        if e.shared_intermediate_size:
            self.shared_expert = MLP(cfg, e.shared_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> each row's expert weights [N, top_k] (model dtype) and expert ids [N, top_k]."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, experts]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            rows, slot = torch.where(ids == expert)  # the rows routed to it, and where in their top_k
            out.index_add_(0, rows, self.experts[expert](x[rows]) * weights[rows, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def mlp_of(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: the mixture of experts where the config routes this layer, else the dense one."""
    return SparseMoE(cfg) if cfg.sparse(layer) else MLP(cfg)
