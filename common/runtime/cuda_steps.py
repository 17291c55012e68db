"""The captured step functions of the CUDA runner (`cuda_runner.py`): one forward written for capture - static shapes,
no host value read, every index on the device - for dense decoders (`StaticStep`) and for the Qwen3.5 hybrids
(`HybridStaticStep`: `hybrid.HybridDecoder`'s arithmetic).

Every product leaves its split partials, which the launch after it adds (`gpu_kernels.linear_parts`): a product costs
one launch. The hybrid step's gated attention layers use the KV cache; its Gated DeltaNet layers read the slot states
from the buffer `reads` names and write the other, in place (`state_cache.StepStates`). A linear layer's q/k/v, z, b
and a projections are one product; the causal convolution (its taps summed in a fixed order in fp32), the decay and
write strength, the recurrence (`gpu_kernels.gated_delta_rule`, its state on chip over the block, each key head read
for the value heads it serves) and the output norm gated by SiLU(z) are one kernel each. What a rollback within the
step replays (the convolution's inputs and outputs, g and beta of every token) is stored with each slot inside the
step; `StepStates` replays it with the recurrence's own arithmetic, so a state rolled back equals the state a plain
decode of the accepted tokens writes.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.kernels import references as kr
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.decoder import Decoder, rope_table
from blockspec.common.models.hybrid import HybridDecoder
from blockspec.common.models.kv_cache import PagedKVCache
from blockspec.common.models.state_cache import HybridPagedKVCache
from blockspec.common.runtime.tensor_parallel import Summed, VocabEmbedding, gathered_logits


class StaticStep(nn.Module):
    """One forward of a dense decoder written for capture: static shapes, no host value read, every index on the
    device. The q/k/v and gate/up weights are merged at build (the decoder's own parameters become views of them)."""

    def weights(self) -> list[torch.Tensor]:
        return step_weights(self)

    def __init__(self, model: Decoder, checkpoint: Checkpoint, cache: PagedKVCache, tap_layers: tuple[int, ...],
                 tap_dest: torch.Tensor | None, numerics: str, max_len: int) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        self.cache, self.tap_layers, self.tap_dest = cache, tap_layers, tap_dest
        self.world, self.vocab = ranks(model), model.embed_tokens
        self.linear, self.linear_parts = products(numerics)
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
                                whole(att.o_proj), layer.post_attention_layernorm.weight,
                                mlp_spec(checkpoint, model, i, whole(layer.mlp))))
        self.final_norm, self.lm_head = model.norm.weight, model.lm_head.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, write_blocks: torch.Tensor,
                real: torch.Tensor, reads: torch.Tensor, tables: torch.Tensor, last: torch.Tensor | None = None) -> tuple:
        """tokens, positions, write_blocks, real (1 or 0) [B, T]; slots [B] (a hybrid's state rows; unused here); reads
        [B] (a hybrid's state buffers; unused here); tables [B, nb] (each row's block table: attention reads key j in
        block tables[b, j // block_size]); last [B] (optional): return only that row of each. -> fp32 logits [B, T or
        1, vocab] and the greedy decision [B, T + 1] (int64: column 0 the drafts a greedy verify of [anchor, d1..]
        accepts, then the argmax of every row). K/V and tap features are stored at (write_blocks, positions modulo the
        block size).

        A layer is ten launches on CUDA: the q/k/v product, q/k norm + rotary with the K/V stores, attention and its
        combine, the output product, add + norm, the gate/up product, SiLU x up, the down product, add + norm. Each
        product leaves its split partials, which the next launch adds (`gpu_kernels.linear_parts`)."""
        cfg = self.cfg
        B, T = tokens.shape
        H, KV = cfg.num_heads, cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        x = embed(self, tokens)  # [B, T, hidden]
        h, residual = gk.add_rms_norm(x[None], None, torch.zeros_like(x), self.layers[0][0], eps)
        taps = []
        n = len(self.layers)
        for i, (_, qkv_w, qkv_b, q_norm, k_norm, o_proj, post_norm, mlp) in enumerate(self.layers):
            q, _ = gk.attention_inputs(self.linear_parts(h, qkv_w), qkv_b, q_norm, k_norm, self.cos, self.sin,
                                       positions, write_blocks, self.cache.k[i], self.cache.v[i], H, KV, eps)
            att = gk.cache_attention(q, self.cache.k[i], self.cache.v[i], tables, positions, self.scale)
            h, residual = gk.add_rms_norm(*row_sum(self, self.linear_parts(att.flatten(2), o_proj.weight),
                                                   o_proj.bias), residual, post_norm, eps)
            h, residual = gk.add_rms_norm(*row_sum(self, *run_mlp(self, h, mlp)), residual,
                                          self.layers[i + 1][0] if i + 1 < n else self.final_norm, eps)
            if i in self.tap_layers:
                taps.append(residual)  # the layer's output
        if n in self.tap_layers:
            taps.append(h)  # the final norm's output
        store_taps(self, taps, write_blocks, positions)
        return greedy_head(self, h, tokens, real.bool(), last)


def store_taps(step, taps: list[torch.Tensor], write_blocks: torch.Tensor, positions: torch.Tensor) -> None:
    """The tap features [B, T, hidden] each, side by side, into the tap buffer [blocks, block_size, n_taps * hidden]
    where the tokens' K/V go."""
    if taps and step.tap_dest is not None:
        step.tap_dest[write_blocks, positions & (step.tap_dest.shape[1] - 1)] = torch.cat(taps, dim=-1)


def ranks(model: nn.Module) -> int:
    """The ranks a model is split over (`tensor_parallel.shard`): 1 for a whole one."""
    return dist.get_world_size() if isinstance(model.embed_tokens, VocabEmbedding) else 1


def whole(module: nn.Module) -> nn.Module:
    """A row-parallel module's own projection (`tensor_parallel.Summed` wraps it in a shard)."""
    return module.inner if isinstance(module, Summed) else module


def embed(step, tokens: torch.Tensor) -> torch.Tensor:
    """The tokens' embeddings; split over ranks: each rank's vocabulary range, summed (`VocabEmbedding`)."""
    return F.embedding(tokens, step.embed) if step.world == 1 else step.vocab(tokens)


def row_sum(step, parts: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row-parallel product's output as `add_rms_norm` takes it: its partials and bias; split over ranks, summed
    over them first (the bias is rank 0's alone: added once), inside the step."""
    if step.world == 1:
        return parts, bias
    x = kr.sum_parts(parts, step.embed.dtype, bias)
    dist.all_reduce(x)
    return x[None], None


def step_weights(step) -> list[torch.Tensor]:
    """Every tensor a step's layers and LM head hold (their weights among them)."""
    found = [step.lm_head]

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, nn.Module):
            found.extend(x.parameters())
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)

    walk(step.layers)
    return found


def products(numerics: str):
    """(linear, linear_parts) of a step: the batch-invariant operators, or ("fast") torch's products."""
    if numerics == "invariant":
        return gk.linear, gk.linear_parts
    return torch.ops.aten.linear.default, lambda x, w: F.linear(x, w)[None]


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


def run_mlp(step, h: torch.Tensor, spec: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's MLP over h [B, T, H] with the step's products, as (split partials, bias) for the add + norm after it:
    the SiLU-gated MLP, or the routed experts (softmax over the router's logits in fp32, top_k, renormalised in rank
    order; `gpu_kernels.moe`) plus a gated shared expert."""
    if spec[0] == "dense":
        _, gate_up, gate_up_bias, down, down_bias = spec
        act = gk.silu_mul(step.linear_parts(h, gate_up), gate_up_bias, h.dtype)
        return step.linear_parts(act, down), down_bias
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
        act = gk.silu_mul(step.linear_parts(x, s_gate_up), None, x.dtype)
        out = out + torch.sigmoid(step.linear(x, s_gate)) * step.linear(act, s_down)
    return out.view(h.shape)[None], None


class HybridStaticStep(nn.Module):
    def weights(self) -> list[torch.Tensor]:
        return step_weights(self)

    def __init__(self, model: HybridDecoder, checkpoint: Checkpoint, cache: HybridPagedKVCache,
                 tap_layers: tuple[int, ...], tap_dest: torch.Tensor | None, numerics: str, max_len: int) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        self.cache, self.states = cache, cache.states
        self.tap_layers, self.tap_dest = tap_layers, tap_dest
        self.world, self.vocab = ranks(model), model.embed_tokens
        self.linear, self.linear_parts = products(numerics)
        self.scale = gk.attention_scale(cfg.head_dim)
        self.embed = model.embed_tokens.weight
        self.cos, self.sin = (t.to(self.embed.device, self.embed.dtype) for t in rope_table(cfg, max_len))
        self.layers = []
        for i, layer in enumerate(model.layers):
            if layer.linear:
                la = layer.linear_attn
                proj = merge(checkpoint, model, i, la, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
                mixer = ("linear", cfg.linear_layers.index(i), proj, la.conv1d.weight[:, 0].float().contiguous(),
                         la.A_log, la.dt_bias, la.norm.weight, whole(la.out_proj).weight)
            else:
                att = layer.self_attn
                mixer = ("attention", cfg.attention_layers.index(i),
                         merge(checkpoint, model, i, att, ("q_proj", "k_proj", "v_proj")), att.q_norm.weight,
                         att.k_norm.weight, whole(att.o_proj).weight)
            self.layers.append((layer.input_layernorm.weight, mixer, layer.post_attention_layernorm.weight,
                                mlp_spec(checkpoint, model, i, whole(layer.mlp))))
        self.final_norm, self.lm_head = model.norm.weight, model.lm_head.weight

    def _attention(self, h, mixer, positions, tables, write_blocks):
        cfg = self.cfg
        _, layer, qkv_w, q_norm, k_norm, o_proj = mixer
        H, KV = cfg.num_heads, cfg.num_kv_heads
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        q, gate = gk.attention_inputs(self.linear_parts(h, qkv_w), None, q_norm, k_norm, self.cos, self.sin, positions,
                                      write_blocks, kc, vc, H, KV, cfg.rms_norm_eps, True, True)
        att = gk.cache_attention(q, kc, vc, tables, positions, self.scale, gate)  # [B, T, H, D], gated
        return self.linear_parts(att.flatten(2), o_proj)

    def _linear_attention(self, h, mixer, slots, real, reads):
        lin = self.cfg.linear
        _, layer, proj, conv_w, a_log, dt_bias, norm_w, out_w = mixer
        B, T, _ = h.shape
        C, Hv = lin.conv_dim, lin.num_v_heads
        parts = self.linear_parts(h, proj)  # q/k/v (the convolution's inputs), z, b, a
        both = gk.causal_conv(parts, self.states.conv[layer], slots, reads, real, conv_w, h.dtype)  # [B, T, 2, C]
        b_col = C + lin.value_dim  # then a: the product's columns are [inputs C | z | b Hv | a Hv]
        gates = gk.delta_gates(parts, b_col, b_col + Hv, a_log, dt_bias, real, h.dtype)  # [B, T, 2, Hv]; 0 at padding
        if T <= self.states.max_block:  # what a rollback within this forward replays, kept with each slot
            self.states.kept[layer, :, :T][slots] = both
            self.states.kept_gates[layer, :, :T][slots] = gates
        out = gk.gated_delta_rule(self.states.recurrent[layer], slots, reads, both, gates, lin.num_k_heads,
                                  lin.k_head_dim ** -0.5)
        out = gk.gated_rms_norm(out, parts, C, norm_w, self.cfg.rms_norm_eps, h.dtype)
        return self.linear_parts(out.reshape(B, T, lin.value_dim), out_w)

    def forward(self, tokens, positions, slots, write_blocks, real, reads, tables, last=None):
        """As `StaticStep.forward`, with slots [B] (each row's state row: the spare one for padding) and reads [B]
        (each row's current state buffer). A Gated DeltaNet layer is eleven launches on CUDA: its input product, the
        convolution (which also writes the next convolution state), the gates, the recurrence (state read and written
        in place), the gated norm, the output product, add + norm, the MLP's three and add + norm; thirteen within a
        verify's width, with the two stores of what a rollback replays."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        slots, reads = slots.contiguous(), reads.contiguous()
        x = embed(self, tokens)
        h, residual = gk.add_rms_norm(x[None], None, torch.zeros_like(x), self.layers[0][0], eps, True)
        taps = []
        n = len(self.layers)
        for i, (_, mixer, post_norm, mlp) in enumerate(self.layers):
            if mixer[0] == "linear":
                out = self._linear_attention(h, mixer, slots, real, reads)
            else:
                out = self._attention(h, mixer, positions, tables, write_blocks)
            h, residual = gk.add_rms_norm(*row_sum(self, out, None), residual, post_norm, eps, True)
            h, residual = gk.add_rms_norm(*row_sum(self, *run_mlp(self, h, mlp)), residual,
                                          self.layers[i + 1][0] if i + 1 < n else self.final_norm, eps, True)
            if i in self.tap_layers:
                taps.append(residual)
        if n in self.tap_layers:
            taps.append(h)  # the final norm's output
        store_taps(self, taps, write_blocks, positions)
        return greedy_head(self, h, tokens, real.bool(), last)


def greedy_head(step, h: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head and the greedy decision of a step (`StaticStep.forward`'s last part)."""
    B = h.shape[0]
    if last is not None:
        h = h[torch.arange(B, device=h.device), last].unsqueeze(1)  # [B, 1, hidden]
    if step.world == 1:
        logits = step.linear(h, step.lm_head).float()  # [B, T', vocab]
    else:  # each rank's vocabulary range, gathered into whole rows
        logits = gathered_logits(step.linear(h, step.vocab.rows(step.lm_head)).float(), step.vocab)
    top = logits.argmax(dim=-1)  # [B, T']
    if last is None:  # greedy verify of [anchor, d1..]: drafts accepted while equal to the target's argmax
        agree = (top[:, :-1] == tokens[:, 1:]) & real[:, 1:]
        accepted = agree.long().cumprod(dim=1).sum(dim=1, keepdim=True)
    else:
        accepted = torch.zeros_like(top[:, :1])
    return logits, torch.cat((accepted, top), dim=1)
