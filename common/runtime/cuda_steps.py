"""The captured step functions of the CUDA runner (`cuda_runner.py`): one forward written for capture - static shapes,
no host value read, every index on the device - for dense decoders (`StaticStep`) and for the Qwen3.5 hybrids
(`HybridStaticStep`: `hybrid.HybridDecoder`'s arithmetic).

The hybrid step's gated attention layers use the KV cache; its Gated DeltaNet layers read the slot states from the
buffer `reads` names and write the other (`state_cache.SlotStates`). A linear layer's q/k/v, z, b and a projections
are one product; the causal convolution (its taps summed in a fixed order in fp32), the decay and write strength, the
recurrence (`gpu_kernels.gated_delta_rule`, its state on chip over the block, each key head read for the value heads
it serves) and the output norm gated by SiLU(z) are one kernel each. What a
rollback within the step replays (the convolution inputs, and k, v, g, beta of every token) comes back as outputs;
the runner keeps them per slot and replays with the same kernel, so a state rolled back equals the state a plain
decode of the accepted tokens writes.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.decoder import Decoder, rope_table
from blockspec.common.models.hybrid import HybridDecoder
from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.models.state_cache import HybridKVCache


class StaticStep(nn.Module):
    """One forward of a dense decoder written for capture: static shapes, no host value read, every index on the
    device. The q/k/v and gate/up weights are merged at build (the decoder's own parameters become views of them)."""

    def __init__(self, model: Decoder, checkpoint: Checkpoint, cache: SlotKVCache, tap_layers: tuple[int, ...],
                 tap_dest: torch.Tensor | None, numerics: str, max_len: int) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        self.cache, self.tap_layers, self.tap_dest = cache, tap_layers, tap_dest
        self.linear = gk.linear if numerics == "invariant" else torch.ops.aten.linear.default
        self.add_norm = gk.add_rms_norm if numerics == "invariant" else gk.add_rms_norm_reference
        self.scale = gk.attention_scale(cfg.head_dim)
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        self.cos, self.sin = (t.to(device, dtype) for t in rope_table(cfg, max_len))
        self.embed = model.embed_tokens.weight
        self.layers = []
        for i, layer in enumerate(model.layers):
            att = layer.self_attn
            qkv = merge(checkpoint, model, i, att, ("q_proj", "k_proj", "v_proj"))
            bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]) if cfg.qkv_bias else None
            empty = self.embed.new_empty(0)
            self.layers.append((layer.input_layernorm.weight, qkv, bias,
                                att.q_norm.weight if cfg.qk_norm else empty, att.k_norm.weight if cfg.qk_norm else empty,
                                att.o_proj, layer.post_attention_layernorm.weight,
                                mlp_spec(checkpoint, model, i, layer.mlp)))
        self.final_norm, self.lm_head = model.norm.weight, model.lm_head.weight

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.linear(x, weight)
        return y if bias is None else y + bias

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, write_slots: torch.Tensor,
                real: torch.Tensor, reads: torch.Tensor, last: torch.Tensor | None = None) -> tuple:
        """tokens, positions, write_slots, real (1 or 0) [B, T]; slots [B]; reads [B] (a hybrid's state buffers; unused here);
        last [B] (optional): return only that row of each. -> fp32 logits [B, T or 1, vocab], the greedy decision
        [B, T + 1] (int64: column 0 the drafts a greedy verify of [anchor, d1..] accepts, then the argmax of every
        row) and what a rollback replays (nothing for a dense model). K/V and tap features are stored at
        (write_slots, positions)."""
        cfg = self.cfg
        B, T = tokens.shape
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        real = real.bool()
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        h, residual = self.add_norm(x, torch.zeros_like(x), self.layers[0][0], eps)
        taps = []
        n = len(self.layers)
        for i, (_, qkv_w, qkv_b, q_norm, k_norm, o_proj, post_norm, mlp) in enumerate(self.layers):
            qkv = self._proj(h, qkv_w, qkv_b).view(B, T, H + 2 * KV, D)
            qk = gk.qk_norm_rope(qkv, q_norm, k_norm, self.cos, self.sin, positions, H, KV, eps)  # [B, T, H + KV, D]
            kc, vc = self.cache.k[i], self.cache.v[i]  # [slots, KV, max_len, D]
            kc[write_slots, :, positions] = qk[:, :, H:]
            vc[write_slots, :, positions] = qkv[:, :, H + KV :]
            att = gk.cache_attention(qk[:, :, :H], kc, vc, slots, positions, self.scale)  # [B, T, H, D]
            h, residual = self.add_norm(self._proj(att.reshape(B, T, H * D), o_proj.weight, o_proj.bias), residual,
                                        post_norm, eps)
            h, residual = self.add_norm(run_mlp(self, h, mlp), residual,
                                        self.layers[i + 1][0] if i + 1 < n else self.final_norm, eps)
            if i in self.tap_layers:
                taps.append(residual)  # the layer's output
        if n in self.tap_layers:
            taps.append(h)  # the final norm's output
        if taps and self.tap_dest is not None:
            self.tap_dest[write_slots, positions] = torch.cat(taps, dim=-1)
        return (*greedy_head(self, h, tokens, real, last), ())


def merge(checkpoint: Checkpoint, model: Decoder, layer: int, module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The weights of module's projections `names` as one [sum of outputs, in] tensor; each projection's parameter
    (and the checkpoint's tensor of it) becomes a view of it, so the merged weight is not held twice."""
    parts = [getattr(module, name).weight for name in names]
    merged = span(parts, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
    if merged is not None:
        return merged  # merged by a runner before this one over the same checkpoint
    merged = torch.cat(parts)
    offset = 0
    for name, part in zip(names, parts):
        adopt(checkpoint, model, module, name, merged[offset : offset + part.shape[0]])
        offset += part.shape[0]
    return merged


def span(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The tensors as one contiguous tensor of `shape`, where they lie back to back in one storage in this order (as
    `merge` and `stack_experts` leave them); None where they do not."""
    storage = parts[0].untyped_storage().data_ptr()
    at = parts[0].data_ptr()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage or p.data_ptr() != at:
            return None
        at += p.numel() * p.element_size()
    strides = tuple(itertools.accumulate(reversed(shape[1:]), lambda a, b: a * b, initial=1))[::-1]
    return torch.as_strided(parts[0], shape, strides)


def adopt(checkpoint: Checkpoint, model: nn.Module, module: nn.Module, name: str, view: torch.Tensor) -> None:
    """module.<name>.weight (and the checkpoint's tensor under that name) becomes `view`."""
    path = next(n for n, m in model.named_modules() if m is module)
    getattr(module, name).weight = nn.Parameter(view, requires_grad=False)
    for key in (f"{path}.{name}.weight", f"model.{path}.{name}.weight"):
        if key in checkpoint.weights:
            checkpoint.weights[key] = view


def stack_experts(checkpoint: Checkpoint, model: nn.Module, moe: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture's routed experts as gate_up [E, 2 I, H] (gate rows first) and down [E, H, I]; each expert's
    parameters become views of them (as `merge`)."""
    experts = list(moe.experts)
    first, last_down = experts[0].gate_proj.weight, experts[0].down_proj.weight
    gate_up = span([w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight)],
                   (len(experts), 2 * first.shape[0], first.shape[1]))
    down = span([e.down_proj.weight for e in experts], (len(experts), *last_down.shape))
    if gate_up is not None and down is not None:
        return gate_up, down  # stacked by a runner before this one
    gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in experts])
    down = torch.stack([e.down_proj.weight for e in experts])
    width = first.shape[0]
    for j, e in enumerate(experts):
        adopt(checkpoint, model, e, "gate_proj", gate_up[j, :width])
        adopt(checkpoint, model, e, "up_proj", gate_up[j, width:])
        adopt(checkpoint, model, e, "down_proj", down[j])
    return gate_up, down


def mlp_spec(checkpoint: Checkpoint, model: nn.Module, layer: int, mlp: nn.Module) -> tuple:
    """What `run_mlp` needs of a layer's MLP: ("dense", gate_up, its bias, down, its bias) or ("moe", router, gate_up,
    down, the shared expert's (gate_up, down, gate) or None, top_k, whether the top_k weights are renormalised)."""
    if hasattr(mlp, "experts"):
        gate_up, down = stack_experts(checkpoint, model, mlp)
        shared = None
        if hasattr(mlp, "shared_expert"):
            se = mlp.shared_expert
            shared = (merge(checkpoint, model, layer, se, ("gate_proj", "up_proj")), se.down_proj.weight,
                      mlp.shared_expert_gate.weight)
        return ("moe", mlp.gate.weight, gate_up, down, shared, mlp.top_k, mlp.norm_topk_prob)
    bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None
    return ("dense", merge(checkpoint, model, layer, mlp, ("gate_proj", "up_proj")), bias, mlp.down_proj.weight,
            mlp.down_proj.bias)


def run_mlp(step, h: torch.Tensor, spec: tuple) -> torch.Tensor:
    """A layer's MLP over h [B, T, H] with the step's products: the SiLU-gated MLP, or the routed experts (softmax over
    the router's logits in fp32, top_k, renormalised in rank order; `gpu_kernels.moe`) plus a gated shared expert."""
    if spec[0] == "dense":
        _, gate_up, gate_up_bias, down, down_bias = spec
        gate, up = step._proj(h, gate_up, gate_up_bias).chunk(2, dim=-1)
        return step._proj(F.silu(gate) * up, down, down_bias)
    _, router, gate_up, down, shared, top_k, renormalise = spec
    x = h.reshape(-1, h.shape[-1])
    weights, ids = torch.topk(torch.softmax(step.linear(x, router).float(), dim=-1), top_k, dim=-1)
    if renormalise:
        total = weights[:, 0]
        for j in range(1, top_k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    out = gk.moe(x, weights.to(x.dtype), ids, gate_up, down)
    if shared is not None:
        s_gate_up, s_down, s_gate = shared
        gate, up = step.linear(x, s_gate_up).chunk(2, dim=-1)
        out = out + torch.sigmoid(step.linear(x, s_gate)) * step.linear(F.silu(gate) * up, s_down)
    return out.view(h.shape)


class HybridStaticStep(nn.Module):
    def __init__(self, model: HybridDecoder, checkpoint: Checkpoint, cache: HybridKVCache,
                 tap_layers: tuple[int, ...], tap_dest: torch.Tensor | None, numerics: str, max_len: int) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        self.cache, self.states = cache, cache.states
        self.tap_layers, self.tap_dest = tap_layers, tap_dest
        self.linear = gk.linear if numerics == "invariant" else torch.ops.aten.linear.default
        self.add_norm = gk.add_rms_norm if numerics == "invariant" else gk.add_rms_norm_reference
        self.scale = gk.attention_scale(cfg.head_dim)
        self.embed = model.embed_tokens.weight
        self.cos, self.sin = (t.to(self.embed.device, self.embed.dtype) for t in rope_table(cfg, max_len))
        self.layers = []
        for i, layer in enumerate(model.layers):
            if layer.linear:
                la = layer.linear_attn
                proj = merge(checkpoint, model, i, la, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
                mixer = ("linear", cfg.linear_layers.index(i), proj, la.conv1d.weight[:, 0].float().contiguous(),
                         la.A_log, la.dt_bias, la.norm.weight, la.out_proj.weight)
            else:
                att = layer.self_attn
                mixer = ("attention", cfg.attention_layers.index(i),
                         merge(checkpoint, model, i, att, ("q_proj", "k_proj", "v_proj")), att.q_norm.weight,
                         att.k_norm.weight, att.o_proj.weight)
            self.layers.append((layer.input_layernorm.weight, mixer, layer.post_attention_layernorm.weight,
                                mlp_spec(checkpoint, model, i, layer.mlp)))
        self.final_norm, self.lm_head = model.norm.weight, model.lm_head.weight

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.linear(x, weight)
        return y if bias is None else y + bias

    def _attention(self, h, mixer, positions, slots, write_slots):
        cfg = self.cfg
        _, layer, qkv_w, q_norm, k_norm, o_proj = mixer
        B, T, _ = h.shape
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        y = self.linear(h, qkv_w)
        q, gate = y[..., : 2 * H * D].view(B, T, H, 2 * D).chunk(2, dim=-1)  # each [B, T, H, D]
        k = y[..., 2 * H * D : (2 * H + KV) * D].view(B, T, KV, D)
        v = y[..., (2 * H + KV) * D :].view(B, T, KV, D)
        qk = gk.qk_norm_rope(torch.cat((q, k), dim=2), q_norm, k_norm, self.cos, self.sin, positions, H, KV,
                             cfg.rms_norm_eps, True)  # [B, T, H + KV, D]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[write_slots, :, positions] = qk[:, :, H:]
        vc[write_slots, :, positions] = v
        att = gk.cache_attention(qk[:, :, :H].contiguous(), kc, vc, slots, positions, self.scale)  # [B, T, H, D]
        return self.linear((att * torch.sigmoid(gate)).reshape(B, T, H * D), o_proj)

    def _linear_attention(self, h, mixer, slots, real, reads, kept):
        lin = self.cfg.linear
        _, layer, proj, conv_w, a_log, dt_bias, norm_w, out_w = mixer
        B, T, _ = h.shape
        C, Hv, Hk, dk, dv = lin.conv_dim, lin.num_v_heads, lin.num_k_heads, lin.k_head_dim, lin.v_head_dim
        y = self.linear(h, proj)  # q/k/v (the convolution's inputs), z, b, a
        mixed, z, b, a = y.split((C, lin.value_dim, Hv, Hv), dim=-1)
        writes = 1 - reads
        k1 = lin.conv_kernel - 1
        conv_state = self.states.conv[layer, slots, reads]  # [B, C, k1]
        conv = gk.causal_conv(conv_state, mixed, conv_w)  # [B, T, C]
        # the new convolution state: the k1 inputs before each row's first padding token
        inputs = torch.cat((conv_state, mixed.transpose(1, 2)), dim=2)  # [B, C, k1 + T]
        ends = real.sum(dim=1)[:, None] + torch.arange(k1, device=h.device)
        self.states.conv[layer, slots, writes] = inputs.gather(2, ends[:, None, :].expand(-1, C, -1))
        kd = Hk * dk
        q = conv[..., :kd].view(B, T, Hk, dk)
        k = conv[..., kd : 2 * kd].view(B, T, Hk, dk)
        v = conv[..., 2 * kd :].view(B, T, Hv, dv)
        g, beta = gk.delta_gates(a, b, a_log, dt_bias, real)  # [B, T, Hv] each; 0 at padding
        out, state = gk.gated_delta_rule(self.states.recurrent[layer, slots, reads], q, k, v, g, beta, dk ** -0.5)
        self.states.recurrent[layer, slots, writes] = state
        kept.append((mixed, k, v, g, beta))
        out = gk.gated_rms_norm(out.to(h.dtype), z.view(B, T, Hv, dv), norm_w, self.cfg.rms_norm_eps)
        return self.linear(out.reshape(B, T, lin.value_dim), out_w)

    def forward(self, tokens, positions, slots, write_slots, real, reads, last=None):
        """As `cuda_runner.StaticStep.forward`, with reads [B] (each row's current state buffer); also returns what a
        rollback replays, per linear layer (conv inputs [B, T, C], k, v, g, beta)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        real = real.bool()
        x = F.embedding(tokens, self.embed)
        h, residual = self.add_norm(x, torch.zeros_like(x), self.layers[0][0], eps, True)
        taps, kept = [], []
        n = len(self.layers)
        for i, (_, mixer, post_norm, mlp) in enumerate(self.layers):
            if mixer[0] == "linear":
                out = self._linear_attention(h, mixer, slots, real, reads, kept)
            else:
                out = self._attention(h, mixer, positions, slots, write_slots)
            h, residual = self.add_norm(out, residual, post_norm, eps, True)
            h, residual = self.add_norm(run_mlp(self, h, mlp), residual,
                                        self.layers[i + 1][0] if i + 1 < n else self.final_norm, eps, True)
            if i in self.tap_layers:
                taps.append(residual)
        if n in self.tap_layers:
            taps.append(h)  # the final norm's output
        if taps and self.tap_dest is not None:
            self.tap_dest[write_slots, positions] = torch.cat(taps, dim=-1)
        return (*greedy_head(self, h, tokens, real, last), kept)


def greedy_head(step, h: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head and the greedy decision of a step (`StaticStep.forward`'s last part)."""
    B = h.shape[0]
    if last is not None:
        h = h[torch.arange(B, device=h.device), last].unsqueeze(1)  # [B, 1, hidden]
    logits = step.linear(h, step.lm_head).float()  # [B, T', vocab]
    top = logits.argmax(dim=-1)  # [B, T']
    if last is None:  # greedy verify of [anchor, d1..]: drafts accepted while equal to the target's argmax
        agree = (top[:, :-1] == tokens[:, 1:]) & real[:, 1:]
        accepted = agree.long().cumprod(dim=1).sum(dim=1, keepdim=True)
    else:
        accepted = torch.zeros_like(top[:, :1])
    return logits, torch.cat((accepted, top), dim=1)
