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
from blockspec.common.models.model_config import ModelConfig

log = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=300)  # a collective that waits this long for a rank fails (a rank that died fails sooner)


def unsupported(cfg: ModelConfig, world: int) -> str | None:
    """Why a model cannot be split over `world` ranks, or None."""
    if world == 1:
        return None
    if cfg.hybrid:
        return "hybrid (Gated DeltaNet) targets are not split yet"
    if cfg.experts is not None:
        return "mixture-of-experts targets are not split yet"
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            return f"its {name} {value} does not divide by {world}"
    return None


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """A rank's view of the config: its heads and MLP width (the vocabulary and hidden size stay whole)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


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

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, start: int, span: int) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.lo, self.hi, self.start, self.span = lo, hi, start, span

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
        emb = self.embed_tokens
        local = F.linear(hidden, emb.rows(self.lm_head.weight)).float()
        local = F.pad(local, (0, emb.span - local.shape[-1])).contiguous()  # the last range: as long as the others
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def shard(model: Decoder, rank: int, world: int) -> ShardedDecoder:
    """Turn a whole decoder (the checkpoint's tensors) into rank's shard in place: its projections become views of
    the rows it keeps, or copies of the columns. Rank 0 keeps the whole embedding and LM head (the drafter reads them
    in place, so a split there would save nothing on its device); the other ranks keep their vocabulary range."""
    cfg = model.cfg
    part = shard_config(cfg, world)
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        att.cfg = part
        for proj in (att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj):
            proj.weight = _param(_rows(proj.weight, rank, world))
            if proj.bias is not None:
                proj.bias = _param(_rows(proj.bias, rank, world))
        for proj in (att.o_proj, mlp.down_proj):
            proj.weight = _param(_cols(proj.weight, rank, world))
            if proj.bias is not None and rank:
                proj.bias = _param(torch.zeros_like(proj.bias))  # added once, by rank 0
        att.o_proj = Summed(att.o_proj)
        layer.mlp = Summed(mlp)
    span = -(-cfg.vocab_size // world)
    lo, hi = rank * span, min((rank + 1) * span, cfg.vocab_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    if rank:
        emb, head = emb[lo:hi].clone(), (None if tied else head[lo:hi].clone())
    model.embed_tokens = VocabEmbedding(emb, lo, hi, 0 if rank else lo, span)
    model.lm_head.weight = model.embed_tokens.weight if tied else _param(head)
    model.__class__ = ShardedDecoder
    model.vocab_size = cfg.vocab_size
    model.cfg = part
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, address: str, device: torch.device) -> None:
    """Join the ranks' process group (gloo on the CPU, NCCL on CUDA) at tcp://address."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world, timeout=TIMEOUT)


def exit_on_lost_rank(e: BaseException) -> None:
    """A collective that failed: a rank is gone, and this one cannot go on alone. The process ends at once (its
    requests end UNAVAILABLE at the router, and the replica is started again as a whole)."""
    log.error("tensor parallel: a rank is gone (%s); this rank exits", e)
    os._exit(1)
