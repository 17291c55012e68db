"""The DFlash-2 block drafter: tap features of the target injected as context K/V, a bidirectional
block [anchor, MASK...], two-tap dynamic convolutions and a pairwise path selector.

Shapes: R blocks (one per request at inference, many per sequence in training), B = block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.common.contracts import Q_WIDTH
from blockspec.common.kernels.cpu_kernels import Linear, fused_linear, linear
from blockspec.common.models.decoder import RMSNorm, apply_rope
from blockspec.common.models.mlp import MLP
from blockspec.common.runtime.distributions import WalkSampler
from blockspec.services.drafter.dflash.config import DFlashConfig


class DynamicConv(nn.Module):
    """Grouped dynamic causal depthwise convolution wrapped around one sublayer.

    y_t = sum_j c_{t,j} * x_{t-j} (j < K taps), inside a block only (slot 0 sees zero padding).
    c = base_kernel + kernel_projection(sublayer input), one coefficient per group of channels;
    index 0 of the first axis is applied before the sublayer, 1 after it.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        base = torch.zeros(2, kernel_size, hidden)
        base[:, 0] = 1.0  # identity at initialisation
        self.base_kernel = nn.Parameter(base)  # [2, K, H]
        self.kernel_projection = Linear(hidden, 2 * kernel_size * hidden // group_size, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:
        """u [R, B, H] -> c [R, B, 2, K, H]."""
        R, B, H = u.shape
        dyn = self.kernel_projection(u).view(R, B, 2, self.kernel_size, H // self.group_size)
        return self.base_kernel + dyn.repeat_interleave(self.group_size, dim=-1)

    @staticmethod
    def apply(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x [R, B, H], c [R, B, K, H] -> [R, B, H]; taps never cross the block start."""
        y = c[:, :, 0] * x
        for j in range(1, c.shape[2]):
            y = y + F.pad(c[:, j:, j] * x[:, :-j], (0, 0, j, 0))
        return y


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, T, H] -> keys, values [R, kv_heads, T, hd] (keys normed and rotated)."""
        R, T, _ = x.shape
        kv = fused_linear(x, (self.k_proj, self.v_proj)).view(R, T, 2 * self.cfg.num_kv_heads, self.cfg.head_dim)
        return self._keys(kv[:, :, : self.cfg.num_kv_heads], cos, sin), kv[:, :, self.cfg.num_kv_heads :].transpose(1, 2)

    def _keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)

    def forward(self, x: torch.Tensor, ctx: "DrafterContext") -> torch.Tensor:
        R, B, _ = x.shape
        H, KV, hd = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj)).view(R, B, H + 2 * KV, hd)
        q = apply_rope(self.q_norm(qkv[:, :, :H]).transpose(1, 2), ctx.block_cos, ctx.block_sin)  # [R, heads, B, hd]
        k_blk = self._keys(qkv[:, :, H : H + KV], ctx.block_cos, ctx.block_sin)  # [R, kv_heads, B, hd]
        v_blk = qkv[:, :, H + KV :].transpose(1, 2)  # [R, kv_heads, B, hd]
        k_ctx, v_ctx = ctx.layer_kv[ctx.layer]  # [R, kv_heads, C, hd]
        keys, values = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)  # [R, kv_heads, C + B, hd]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.layer_mask(), enable_gqa=True)  # [R, heads, B, hd]
        return self.o_proj(out.transpose(1, 2).reshape(R, B, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # gate/up/down without bias, as Qwen3
        if cfg.conv_kernel_size:
            self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def _wrapped(self, sublayer, conv: DynamicConv | None, u: torch.Tensor, *args) -> torch.Tensor:
        if conv is None:
            return sublayer(u, *args)
        c = conv.coefficients(u)  # both coefficient sets come from the sublayer's input
        return conv.apply(sublayer(conv.apply(u, c[:, :, 0]), *args), c[:, :, 1])

    def forward(self, x: torch.Tensor, ctx: "DrafterContext", use_conv: bool) -> torch.Tensor:
        attn_conv = getattr(self, "attention_conv", None) if use_conv else None
        mlp_conv = getattr(self, "mlp_conv", None) if use_conv else None
        x = x + self._wrapped(self.self_attn, attn_conv, self.input_layernorm(x), ctx)
        return x + self._wrapped(self.mlp, mlp_conv, self.post_attention_layernorm(x))


class DrafterContext:
    """What every layer's attention needs: context K/V per layer, block RoPE and the visibility masks."""

    def __init__(
        self,
        layer_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [R, kv_heads, C, hd] each
        ctx_visible: torch.Tensor,  # [R, C] bool: context positions this block may see (context key c: position c)
        block_cos_sin: tuple[torch.Tensor, torch.Tensor],  # [R, 1, B, hd] each
        cfg: DFlashConfig | None = None,  # its layer types and causality; None: every layer plain
        positions: torch.Tensor | None = None,  # [R, B] the block slots' positions (with cfg)
    ) -> None:
        self.layer_kv = layer_kv
        self.block_cos, self.block_sin = block_cos_sin
        self.ctx_visible, self.cfg, self.positions = ctx_visible, cfg, positions
        R, B = ctx_visible.shape[0], self.block_cos.shape[2]
        # Plain layers: every block slot sees the visible context and the whole block (bidirectional): [R, 1, 1, C + B].
        self.mask = torch.cat([ctx_visible, torch.ones(R, B, dtype=torch.bool, device=ctx_visible.device)], dim=1)[:, None, None, :]
        self._masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        self.layer = 0

    def layer_mask(self) -> torch.Tensor:
        """The current layer's mask: the plain one, or [R, 1, B, C + B] for a causal or sliding-window layer (slot
        at position p sees keys at positions in (p - window, p + window), and with causality none after p)."""
        cfg = self.cfg
        if cfg is None or cfg.plain_attention:
            return self.mask
        causal = cfg.layer_causal(self.layer)
        window = cfg.sliding_window if cfg.layer_type(self.layer) == "sliding_attention" else None
        if not causal and window is None:
            return self.mask
        if (causal, window) not in self._masks:
            q = self.positions[:, :, None]  # [R, B, 1]
            ctx_pos = torch.arange(self.ctx_visible.shape[1], device=q.device)[None, None, :]  # [1, 1, C]
            ctx = self.ctx_visible[:, None, :].expand(-1, q.shape[1], -1)  # [R, B, C]
            block = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device)  # [B, B]
            if causal:
                block = block.tril()
            if window is not None:
                ctx = ctx & (q - ctx_pos < window)
                slots = torch.arange(q.shape[1], device=q.device)
                block = block & ((slots[:, None] - slots[None, :]).abs() < window)
            self._masks[causal, window] = torch.cat([ctx, block.expand(q.shape[0], -1, -1)], dim=2)[:, None]
        return self._masks[causal, window]


class CandidateSelector(nn.Module):
    """Pairwise path selector: S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)> over the top-k candidates of slot t."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        r = cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.sampling_width = cfg.sampling_width  # candidates a slot of a walk that samples
        self.hidden_projection = Linear(cfg.hidden_size, r, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, r) * 0.02)  # A: [V, r]
        self.successor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, r) * 0.02)  # B: [V, r]

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], unary/candidates [..., top_k], prev [...] -> S [..., top_k]."""
        query = self.predecessor_codebook[prev] * self.hidden_projection(hidden)  # [..., r]
        return unary + (self.successor_codebook[candidates] * query.unsqueeze(-2)).sum(-1)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             sampler: WalkSampler | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Left-to-right walk from the anchor. hidden [R, S, H], logits [R, S, V], anchor [R] -> tokens [R, S].
        ids: the token id of each logit column (a draft vocabulary), None where column v is token v.

        At slot t each row takes the candidate with the best score (the greedy walk), or the one `sampler`
        (common/distributions.WalkSampler: first given every slot's first Q_WIDTH candidates) picks from the
        scores [R, width]; the chosen token is the next slot's predecessor. With a sampler the candidates are the top
        sampling_width, of which greedy rows still score the first top_k.
        """
        width = self.top_k if sampler is None else self.sampling_width
        unary, candidates = logits.topk(min(width, logits.shape[-1]), dim=-1)  # [R, S, width]
        if ids is not None:
            candidates = ids[candidates]
        R, S, K = unary.shape
        # Every slot's scores for every predecessor it can have, in a few batched ops: slot 0 follows the
        # anchor (K copies of it), slot t one of slot t - 1's candidates. table[r, t, a, b] = S_t(a, b).
        prev = torch.cat([anchor[:, None, None].expand(R, 1, K), candidates[:, :-1]], dim=1)  # [R, S, K]
        query = self.predecessor_codebook[prev] * self.hidden_projection(hidden)[:, :, None]  # [R, S, K, r]
        table = unary[:, :, None] + query @ self.successor_codebook[candidates].transpose(-1, -2)  # [R, S, K, K]
        rows, index = torch.arange(R, device=unary.device), torch.zeros(R, dtype=torch.long, device=unary.device)
        if sampler is not None:
            sampler.begin(candidates[..., :Q_WIDTH], greedy_width=self.top_k)
        chosen = []
        for t in range(S):
            s = table[rows, t, index]  # [R, top_k]: the scores after the predecessor chosen at t - 1
            index = s.argmax(-1) if sampler is None else sampler(t, s)
            chosen.append(index)
        return candidates.gather(2, torch.stack(chosen, 1)[..., None]).squeeze(2)  # [R, S]



class DFlashDrafter(nn.Module):
    """Weights under the published names; no embedding table or LM head of its own."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.selector_rank:
            self.candidate_selector = CandidateSelector(cfg)
        self.draft_vocab: torch.Tensor | None = None  # token ids of the LM head rows it drafts from (None: all)

    def block_embeds(self, embedding: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input: the target's embeddings of [anchor, MASK...] block_ids [R, B] -> [R, B, H], scaled
        where the config says so."""
        x = embedding[block_ids]
        return x * self.cfg.input_embedding_scale if self.cfg.input_embedding_scale is not None else x

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Concatenated tap features [..., n_taps * H] -> fused context hidden states [..., H]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context hidden [R, C, H] at positions given by cos/sin [R, 1, C, hd] -> K/V of every layer."""
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, ctx: DrafterContext, use_conv: bool = True) -> torch.Tensor:
        """block_embeds [R, B, H] (anchor + MASK embeddings from the target) -> normed hidden [R, B, H]."""
        x = block_embeds
        for i, layer in enumerate(self.layers):
            ctx.layer = i
            x = layer(x, ctx, use_conv)
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Draft-slot hidden [..., H] -> logits [..., V] through the target's LM head weight [V, H]."""
        logits = linear(hidden, lm_head).float()
        if self.cfg.output_multiplier is not None:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits
