"""Tensor parallelism (model.tensor_parallel_size): one target split over ranks with torch.distributed (gloo on the
CPU, NCCL on GPUs), Megatron's layout.

* Attention: each rank holds num_heads / world query heads and num_kv_heads / world KV heads (q, k, v projections
  split by rows, o_proj by columns) and its heads' part of the KV cache; MLP: gate and up by rows, down by columns.
  The two row-parallel outputs of a layer are summed over the ranks (all_reduce); their bias, where the model has
  one, is added by rank 0 only.
* Embedding and LM head: split over the vocabulary. A rank looks up the ids of its range (the others give zeros),
  then the rows are summed; the LM head gives each rank its range's logits, gathered into the whole row.
* Rank 0 leads (common/runtime/tp_ranks.py): it serves the verifier role, and before each forward sends the step (its
  segments and each slot's length) to the other ranks, which run the same forward on their shards.

Exactness: a row's partial sums are computed as at one rank, from shapes that do not depend on the batch, and a sum
of two ranks' partials is one floating-point addition, the same whichever rank adds; so at a given world size
speculative output equals plain decoding's token for token. Against tensor_parallel_size 1 it can differ where two
logits are within the rounding of the split products (the agreement is measured, docs/exactness.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from blockspec.common.models.decoder import Decoder
from blockspec.common.models.hybrid import HybridDecoder
from blockspec.common.models.model_config import ModelConfig

log = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=300)  # a collective that waits this long for a rank fails (a rank that died fails sooner)


def unsupported(cfg: ModelConfig, world: int) -> str | None:
    """Why a model cannot be split over `world` ranks, or None."""
    if world == 1:
        return None
    if cfg.num_heads % world:
        return f"its num_attention_heads {cfg.num_heads} does not divide by {world}"
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        return f"its num_key_value_heads {cfg.num_kv_heads} does not divide by {world}, nor {world} by it"
    sizes = []
    if any(not cfg.sparse(i) for i in range(cfg.num_layers)):
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.hybrid:
        sizes += [("linear_num_key_heads", cfg.linear.num_k_heads), ("linear_num_value_heads", cfg.linear.num_v_heads)]
    if cfg.experts is not None:
        sizes.append(("moe_intermediate_size", cfg.experts.intermediate_size))
        if cfg.experts.shared_intermediate_size:
            sizes.append(("shared_expert_intermediate_size", cfg.experts.shared_intermediate_size))
    for name, value in sizes:
        if value % world:
            return f"its {name} {value} does not divide by {world}"
    return None


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """A rank's view of the config: its heads (attention, and a hybrid's key and value heads) and MLP widths (each
    expert's too); the vocabulary, hidden size and head sizes stay whole. Fewer KV heads than ranks: each rank holds
    the one its query heads read (`_split_kv`)."""
    linear = cfg.linear and dataclasses.replace(cfg.linear, num_k_heads=cfg.linear.num_k_heads // world,
                                                num_v_heads=cfg.linear.num_v_heads // world)
    experts = cfg.experts and dataclasses.replace(cfg.experts, intermediate_size=cfg.experts.intermediate_size // world,
                                                  shared_intermediate_size=cfg.experts.shared_intermediate_size // world)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=max(1, cfg.num_kv_heads // world),
                               intermediate_size=cfg.intermediate_size // world, linear=linear, experts=experts)


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]  # a view: no copy


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[1] // world
    return t[:, rank * n : (rank + 1) * n].contiguous()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Summed(nn.Module):
    """A row-parallel module: its output summed over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


class VocabEmbedding(nn.Module):
    """The embedding of one vocabulary range [lo, hi) (the last range may be shorter than `span`); `weight`'s row
    `start` is id lo. Rank 0 keeps the whole table (start = lo): the drafter reads it in place; the other ranks hold
    their range only (start 0)."""

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, start: int, span: int, vocabulary: int) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.lo, self.hi, self.start, self.span, self.vocabulary = lo, hi, start, span, vocabulary

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        return weight[self.start : self.start + self.hi - self.lo]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, 0)
        rows = F.embedding(local, self.rows(self.weight)) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(rows)
        return rows


class ShardedDecoder(Decoder):
    """A Decoder whose modules hold one rank's shard (`shard`): the torch path (the CPU's one-call decoder kernel
    takes whole layers), the LM head's ranges gathered into whole rows on every rank."""

    def _row_weights(self):
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gathered_logits(F.linear(hidden, self.embed_tokens.rows(self.lm_head.weight)).float(), self.embed_tokens)


def gathered_logits(local: torch.Tensor, vocab: VocabEmbedding) -> torch.Tensor:
    """Each rank's logits of its vocabulary range [..., hi - lo] gathered into whole rows [..., vocabulary]."""
    local = F.pad(local, (0, vocab.span - local.shape[-1])).contiguous()  # the last range: as long as the others
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=-1)[..., : vocab.vocabulary]


def _split_rows(module: nn.Module, rank: int, world: int) -> None:
    """A column-parallel projection: rank's rows of its weight (and bias)."""
    module.weight = _param(_rows(module.weight, rank, world))
    if getattr(module, "bias", None) is not None:
        module.bias = _param(_rows(module.bias, rank, world))


def _split_kv(module: nn.Module, rank: int, world: int, kv_heads: int) -> None:
    """A k or v projection: rank's KV heads, or where there are fewer than ranks, the one KV head its query heads
    read (the heads repeated over ranks, as vLLM does)."""
    if kv_heads >= world:
        _split_rows(module, rank, world)
        return
    per, head = module.weight.shape[0] // kv_heads, rank * kv_heads // world
    module.weight = _param(module.weight[head * per : (head + 1) * per])
    if getattr(module, "bias", None) is not None:
        module.bias = _param(module.bias[head * per : (head + 1) * per])


def _split_cols(module: nn.Module, rank: int, world: int) -> None:
    """A row-parallel projection: rank's columns of its weight; its bias added once, by rank 0."""
    module.weight = _param(_cols(module.weight, rank, world))
    if getattr(module, "bias", None) is not None and rank:
        module.bias = _param(torch.zeros_like(module.bias))


def _split_mlp(mlp: nn.Module, rank: int, world: int) -> None:
    """A SiLU-gated MLP split by its intermediate width; a mixture of experts: each expert and the shared expert so
    split, the router and the shared expert's gate whole on every rank (every rank routes alike)."""
    if hasattr(mlp, "experts"):
        for expert in [*mlp.experts, *([mlp.shared_expert] if hasattr(mlp, "shared_expert") else [])]:
            _split_mlp(expert, rank, world)
        return
    _split_rows(mlp.gate_proj, rank, world)
    _split_rows(mlp.up_proj, rank, world)
    _split_cols(mlp.down_proj, rank, world)


def _split_deltanet(la: nn.Module, part: ModelConfig, rank: int, world: int) -> None:
    """A Gated DeltaNet layer split by heads: rank's key heads of q and k and its value heads of v (their rows of the
    q/k/v projection and channels of the convolution), of z, b, a, A_log and dt_bias; the output projection by
    columns. Value head h is served by key head h // (Hv / Hk): a rank's value heads by its own key heads."""
    lin = la.lin
    kd, vd = lin.num_k_heads * lin.k_head_dim, lin.value_dim
    k_span, v_span = kd // world, vd // world
    keep = torch.cat([torch.arange(rank * k_span, (rank + 1) * k_span) + offset for offset in (0, kd)]
                     + [torch.arange(rank * v_span, (rank + 1) * v_span) + 2 * kd])
    la.in_proj_qkv.weight = _param(la.in_proj_qkv.weight[keep])
    la.conv1d.weight = _param(la.conv1d.weight[keep])
    for module in (la.in_proj_z, la.in_proj_b, la.in_proj_a):
        _split_rows(module, rank, world)
    la.A_log, la.dt_bias = _param(_rows(la.A_log, rank, world)), _param(_rows(la.dt_bias, rank, world))
    _split_cols(la.out_proj, rank, world)
    la.out_proj = Summed(la.out_proj)
    la.cfg, la.lin = part, part.linear


class ShardedHybridDecoder(ShardedDecoder, HybridDecoder):
    """A hybrid's shard: the hybrid layers' forward, the LM head's ranges gathered (`ShardedDecoder`)."""


def shard(model: Decoder, rank: int, world: int) -> ShardedDecoder:
    """Turn a whole decoder (the checkpoint's tensors) into rank's shard in place: its projections become views of
    the rows it keeps, or copies of the columns. Rank 0 keeps the whole embedding and LM head (the drafter reads them
    in place, so a split there would save nothing on its device); the other ranks keep their vocabulary range. A
    hybrid's Gated DeltaNet layers split by heads (`_split_deltanet`), a mixture's experts by their widths."""
    cfg = model.cfg
    part = shard_config(cfg, world)
    for layer in model.layers:
        if getattr(layer, "linear", False):
            _split_deltanet(layer.linear_attn, part, rank, world)
        else:
            att = layer.self_attn
            att.cfg = part
            _split_rows(att.q_proj, rank, world)  # a gated q_proj's rows: each head's queries, then its gate
            _split_kv(att.k_proj, rank, world, cfg.num_kv_heads)
            _split_kv(att.v_proj, rank, world, cfg.num_kv_heads)
            _split_cols(att.o_proj, rank, world)
            att.o_proj = Summed(att.o_proj)
        _split_mlp(layer.mlp, rank, world)
        layer.mlp = Summed(layer.mlp)
    span = -(-cfg.vocab_size // world)
    lo, hi = rank * span, min((rank + 1) * span, cfg.vocab_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    if rank:
        emb, head = emb[lo:hi].clone(), (None if tied else head[lo:hi].clone())
    model.embed_tokens = VocabEmbedding(emb, lo, hi, 0 if rank else lo, span, cfg.vocab_size)
    model.lm_head.weight = model.embed_tokens.weight if tied else _param(head)
    model.__class__ = ShardedHybridDecoder if cfg.hybrid else ShardedDecoder
    model.vocab_size = cfg.vocab_size
    model.cfg = part
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """The device `rank` runs on: on CUDA the lead's GPU index (0 where it names none) plus the rank, so ranks 0 and 1
    of a lead on `cuda` (or `cuda:0`) take GPUs 0 and 1, of a lead on `cuda:2` GPUs 2 and 3; the CPU itself."""
    device = torch.device(device)
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def init(rank: int, world: int, address: str, device: torch.device) -> None:
    """Join the ranks' process group (gloo on the CPU, NCCL on CUDA) at tcp://address; on CUDA this process's current
    device becomes `device` (an indexed one: `rank_device`)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"rank {rank}: {device} names no GPU index (rank_device gives each rank its own)")
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world, timeout=TIMEOUT)


def exit_on_lost_rank(e: BaseException) -> None:
    """A collective that failed: a rank is gone, and this one cannot go on alone. The process ends at once (its
    requests end UNAVAILABLE at the router, and the replica is started again as a whole)."""
    log.error("tensor parallel: a rank is gone (%s); this rank exits", e)
    os._exit(1)
