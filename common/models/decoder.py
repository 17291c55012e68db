"""The Llama / Qwen2 / Qwen3 decoder, written lean: weights under the HF names, attention over a slot KV cache."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.common.kernels import cpu_kernels
from blockspec.common.kernels.cpu_kernels import Linear, attends_in_place, cached_attention, fused_linear
from blockspec.common.models.kv_cache import PagedKVCache
from blockspec.common.models.mlp import mlp_of
from blockspec.common.models.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers: normalise in fp32, scale in the model dtype. In fp32 on the CPU one C++
    # call (cpu_kernels.rms_norm); elsewhere torch's rms_norm, the same bits as transformers' six operations
    # (both checked in tests/common/kernels/test_cpu_kernels.py).
    if x.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        y = cpu_kernels.rms_norm(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps) if y is None else y
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] (rope_dim: head_dim, or the rotary part of a head), with Llama 3 frequency
    scaling when configured."""
    dim = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not cfg.rope_scaling:
        return inv
    s = dict(cfg.rope_scaling)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s["factor"], inv)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_len, rope_dim], in the rotate-half layout transformers uses."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg))  # [max_len, rope_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rope_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, hd]; cos/sin: [B, 1, T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, layer: int, batch: "AttentionBatch") -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, KV = cfg.num_heads, cfg.num_kv_heads
        qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj)).view(B, T, H + 2 * KV, cfg.head_dim)
        v = qkv[:, :, H + KV :]  # [B, T, kv_heads, hd]
        qk = cpu_kernels.qk_norm_rope(qkv, self.q_norm.weight if cfg.qk_norm else None,
                                      self.k_norm.weight if cfg.qk_norm else None, batch.cos_sin, batch.positions, H, KV,
                                      cfg.rms_norm_eps)  # [B, heads + kv_heads, T, hd], or None off the CPU in fp32
        if qk is None:
            qk = qkv[:, :, : H + KV]
            if cfg.qk_norm:  # q and k heads normed in one op: row-wise, each head with its own weight
                qk = rms_norm(qk, torch.cat([self.q_norm.weight.expand(H, -1), self.k_norm.weight.expand(KV, -1)]),
                              cfg.rms_norm_eps)
            qk = apply_rope(qk.transpose(1, 2), batch.cos, batch.sin)  # [B, heads + kv_heads, T, hd]
        batch.write(layer, qk[:, H:], v.transpose(1, 2))
        if batch.in_place:  # short queries on the CPU: one C++ call over the cache as it lies
            return self.o_proj(cached_attention(qk[:, :H], batch.cache.k[layer], batch.cache.v[layer], batch.tables,
                                                batch.positions, batch.cache.block_shift))
        keys, values = batch.read(layer)
        # out: [B, heads, T, hd]
        out = F.scaled_dot_product_attention(qk[:, :H], keys, values, attn_mask=batch.mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_of(cfg, layer)

    def forward(self, x: torch.Tensor, layer: int, batch: "AttentionBatch") -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


def final_norm(norm: nn.Module, x: torch.Tensor, taps: list[torch.Tensor], tapped: bool
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decoder's output norm(x) and its taps, with norm(x) as the last of them where `tapped` (tap id num_layers)."""
    hidden = norm(x)
    return hidden, [*taps, hidden] if tapped else taps


class AttentionBatch:
    """Per-forward attention inputs shared by every layer: where each row sits and what it may see."""

    def __init__(
        self,
        cache: PagedKVCache,
        slots: torch.Tensor,  # [B] cache slot of each row of the batch
        positions: torch.Tensor,  # [B, T] absolute position of each query token
        real: torch.Tensor,  # [B, T] bool: False for padding rows (computed, never stored or returned)
        key_len: int,  # keys read per slot: positions [0, key_len)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        host_slots: list[int],  # slots as ints, the first position and the real tokens of each row: known
        host_starts: list[int],  # on the host, so no device value is read back
        host_lengths: list[int],
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,  # a token tree's (rope positions, visible keys)
    ) -> None:
        """tree: where a segment is a token tree (runner.Segment.parents), its tokens' positions for RoPE [B, T] (the
        committed length plus their depth) and the keys each may see [B, T, key_len] (the committed ones and its
        ancestors'); `positions` is then where their K/V are stored. Such a forward runs SDPA with that mask."""
        self.store_positions = positions  # [B, T] where each token's K/V (and taps) go
        if tree is not None:
            positions = tree[0]
        self.cache, self.slots, self.positions, self.key_len = cache, slots, positions, key_len
        self.real = real
        # each row's block table [B, nb] over keys [0, key_len) (a slot cache's: [slot])
        tables = cache.tables(host_slots, key_len)
        self.tables = tables if tables.device == positions.device else tables.to(positions.device, non_blocking=True)
        self.states = None  # a hybrid model's linear layers: the forward's `state_cache.StateStep`
        all_real = min(host_lengths) == positions.shape[1]
        self.spans = (host_starts, host_lengths)  # `cpu_kernels.decoder_rows` stores the K/V by them
        self.cos_sin = cos_sin  # the tables [max_len, hd]; `cos` and `sin` gather them where torch's RoPE runs
        # Attention reads the cache in place (`cached_attention`) where it applies, else SDPA over the
        # gathered keys with a mask.
        self.in_place = tree is None and attends_in_place(cache.k, positions.shape[1])
        self.mask = None if tree is None else tree[1].unsqueeze(1)  # [B, 1, T, key_len]: only SDPA needs it
        if not self.in_place and tree is None:
            keys = torch.arange(key_len, device=positions.device)
            self.mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        # Where the real tokens' K/V go, worked out once for every layer (`_stored` when first asked:
        # one row of real tokens, a decode's, never asks).
        self.all_real = all_real
        self.rows = None if self.all_real else real.nonzero(as_tuple=True)  # (b, t) of each real token

    @functools.cached_property
    def _stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The real tokens' (block, offset in it) [N] each, in the order of `real_rows`."""
        B, T = self.store_positions.shape
        if self.all_real:
            rows, positions = torch.arange(B, device=self.tables.device).repeat_interleave(T), self.store_positions.reshape(-1)
        else:
            rows, positions = self.rows[0], self.store_positions[self.rows]
        return self.cache.blocks_of(self.tables, rows, positions)

    @functools.cached_property
    def cos(self) -> torch.Tensor:  # [B, 1, T, hd]
        return self.cos_sin[0][self.positions].unsqueeze(1)

    @functools.cached_property
    def sin(self) -> torch.Tensor:  # [B, 1, T, hd]
        return self.cos_sin[1][self.positions].unsqueeze(1)

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> the real tokens' rows [N, ...], in the order `_stored` places them."""
        return x.reshape(-1, *x.shape[2:]) if self.all_real else x[self.rows]

    def store(self, dest: torch.Tensor, rows: torch.Tensor) -> None:
        """The real tokens' rows [N, ...] into dest [blocks, block_size, ...] (laid out as the cache's blocks) at their
        positions: one scatter."""
        dest[self._stored] = rows

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real tokens' k, v [B, kv_heads, T, hd] in the cache ([blocks, kv_heads, block_size, hd]:
        `store` with the layout's own indexing)."""
        blocks, offsets = self._stored
        for cache, new in ((self.cache.k[layer], k), (self.cache.v[layer], v)):
            cache[blocks, :, offsets] = self.real_rows(new.transpose(1, 2))  # [N, kv_heads, hd]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [B, kv_heads, key_len, hd] of each row, gathered from its blocks."""
        return self.cache.gather(layer, self.tables, self.key_len)


class Decoder(nn.Module):
    """Token ids in, final hidden states (and tapped layer outputs) out; `logits` applies the LM head. A subclass
    (hybrid.HybridDecoder) swaps the layer and the norm classes."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # _row_weights: (the projections copied, their versions, the weights, the LM head's panels or None)
        self._row: tuple | None = None

    def forward(
        self, tokens: torch.Tensor, batch: AttentionBatch, tap_layers: tuple[int, ...] = (),
        tap_dest: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """tokens [B, T] -> normed hidden [B, T, H] and the outputs of the decoder layers in `tap_layers` (tap id
        num_layers: the final norm's output, what transformers returns as the last hidden state). A forward
        attending in place (the requests' decodes, verifies and short prefill chunks on the CPU) of at most
        MAX_ROWS tokens runs as one C++ call where the kernels take the weights (`cpu_kernels.decoder_rows`, bitwise
        this path); given a tap_dest it takes (`cpu_kernels.stores_taps`), that call puts the taps' real rows there
        (at their slot and position, as `batch.store` would) and returns None for them."""
        fits = batch.in_place and tokens.numel() <= cpu_kernels.MAX_ROWS
        weights = self._row_weights() if fits else None
        if weights is not None:
            dest = tap_dest if tap_layers and cpu_kernels.stores_taps(tap_dest) else None
            hidden, *taps = cpu_kernels.decoder_rows(
                tokens, self.embed_tokens.weight, weights, self.norm.weight, batch.cache, batch.cos_sin, batch.positions,
                batch.tables, batch.spans, sorted(tap_layers), self.cfg.num_heads, self.cfg.num_kv_heads,
                self.cfg.rms_norm_eps, dest)
            return hidden, None if dest is not None else taps
        x = self.embed_tokens(tokens)  # [B, T, H]
        taps = []
        for i, layer in enumerate(self.layers):
            x = layer(x, i, batch)
            if i in tap_layers:
                taps.append(x)
        return final_norm(self.norm, x, taps, len(self.layers) in tap_layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden [..., H] -> fp32 logits. Rows [N, H] of a decoder that runs as one C++ call go
        straight to its packed head, the kernel `lm_head` itself calls (the module call around it is a visible share of
        a decode)."""
        if (hidden.is_cpu and hidden.dim() == 2 and 0 < hidden.shape[0] <= cpu_kernels.MAX_ROWS
                and hidden.is_contiguous() and hidden.dtype == torch.float32 and not torch.is_grad_enabled()
                and cpu_kernels.enabled() and self._row_weights() is not None and self._row[3] is not None):
            return cpu_kernels.packed_linear(hidden, self._row[3])
        return self.lm_head(hidden).float()

    def _row_weights(self) -> list[torch.Tensor] | None:
        """`decoder_rows`'s weights (8 a layer, the projections packed), gathered again only after a projection they
        copy changed in place (the norms go as views, which see such changes): checking every parameter each
        forward would cost more than a decode's Python saves. None where it does not apply: biases, shapes or
        weights the kernels do not take, a packing budget spent."""
        if self._row is None or tuple(w._version for w in self._row[0]) != self._row[1]:
            copied, weights = self._gather_row_weights()
            head = (self.lm_head.weight,)
            head = cpu_kernels.packed(head) if weights is not None and cpu_kernels.kernel_weights(head) else None
            self._row = (copied, tuple(w._version for w in copied), weights, head)
        return self._row[2]

    def _gather_row_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        cfg = self.cfg
        if cfg.experts is not None:  # routed experts: the torch path
            return [self.lm_head.weight], None
        groups = [[(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (a.o_proj.weight,),
                   (m.gate_proj.weight, m.up_proj.weight), (m.down_proj.weight,)]
                  for a, m in ((layer.self_attn, layer.mlp) for layer in self.layers)]
        copied = [w for layer in groups for group in layer for w in group] + [self.lm_head.weight]
        if (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.hidden_size % 16 or cfg.head_dim % 16
                or cfg.head_dim > 1024 or self.embed_tokens.weight.dtype != torch.float32):
            return copied, None
        weights = []
        for layer, layer_groups in zip(self.layers, groups):
            panels = [cpu_kernels.packed(g) if cpu_kernels.kernel_weights(g) else None for g in layer_groups]
            if any(p is None for p in panels):
                return copied, None
            att = layer.self_attn
            q_norm, k_norm = ((att.q_norm.weight.detach(), att.k_norm.weight.detach()) if cfg.qk_norm
                              else (cpu_kernels.NO_WEIGHT, cpu_kernels.NO_WEIGHT))
            weights += [layer.input_layernorm.weight.detach(), panels[0], q_norm, k_norm, panels[1],
                        layer.post_attention_layernorm.weight.detach(), panels[2], panels[3]]
        return copied, weights
