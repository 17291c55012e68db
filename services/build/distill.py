"""Distil a DFlash-2 drafter from a target: sequence-level distillation on the target's own greedy
continuations, random anchors, decay-weighted block cross-entropy plus the path selector's loss."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from blockspec.common.decoder import rope_table
from blockspec.common.models import load_checkpoint
from blockspec.common.runner import Runner, Segment
from blockspec.services.drafter.dflash.checkpoint import save_drafter
from blockspec.services.drafter.dflash.config import DFlashConfig
from blockspec.services.drafter.dflash.model import DFlashDrafter, DrafterContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    block_size: int = 8  # anchor + 7 draft slots, as the published drafter
    num_layers: int = 1
    intermediate_size: int | None = None  # default: the target's hidden size
    num_heads: int = 4
    num_kv_heads: int = 1
    target_layer_ids: tuple[int, ...] | None = None  # default: spread from the first layer to the last
    conv_kernel_size: int | None = 2
    conv_group_size: int = 16
    selector_rank: int | None = 8  # codebooks cost vocab x rank each: keep small for small targets
    selector_top_k: int = 16
    anchors_per_sequence: int = 16
    batch_sequences: int = 8
    steps: int = 400
    lr: float = 3e-3
    warmup_steps: int = 20
    decay_gamma: float = 4.0  # slot weight exp(-(k - 1) / gamma): later slots matter less
    selector_loss_weight: float = 0.5
    seed: int = 0
    init_from: str | None = None  # warm start from this drafter checkpoint (same shapes): a refinement stage
    feature_dtype: str = "float32"  # tap features kept in memory as this ("float16" halves a large run's RAM)


def default_taps(num_layers: int, n: int = 3) -> tuple[int, ...]:
    """n layer ids spread from the first layer to the last."""
    return tuple(sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)}))


def drafter_config(target_dir: str | Path, cfg: DistillConfig) -> DFlashConfig:
    target = load_checkpoint(target_dir)
    t = target.config
    return DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=cfg.intermediate_size or t.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=t.hidden_size // cfg.num_heads,
        vocab_size=t.vocab_size, num_target_layers=t.num_layers,
        target_layer_ids=cfg.target_layer_ids or default_taps(t.num_layers), block_size=cfg.block_size,
        mask_token_id=target.tokenizer.mask_token_id, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k, short_blocks=True,  # greedy drafts of k + 1 slots: see docs/models.md
    )


def greedy_continuations(target_dir: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int = 16,
                         progress: bool = True) -> list[list[int]]:
    """The supervision: prompt + the target's own greedy continuation, for every prompt."""
    from blockspec.services.serving.engine import Engine

    engine = Engine(target_dir, None, "none", max_batch=batch, max_len=max(len(p) for p in prompts) + new_tokens,
                    threads=torch.get_num_threads())
    requests = [engine.request(str(i), p, new_tokens) for i, p in enumerate(prompts)]
    with tqdm(total=len(prompts), desc="target continuations", unit="seq", disable=not progress) as bar:
        done = engine.complete(requests, on_finish=lambda _: bar.update())
    return [list(r.prompt_ids) + list(e.token_ids) for r, e in zip(requests, done)]


@torch.inference_mode()
def tap_features(runner: Runner, sequences: Sequence[Sequence[int]], batch: int = 8,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Target tap features [len, n_taps * H] of every position of every sequence: views of one tensor of
    `dtype`, filled batch by batch: per-batch fp32 results kept until the end take far more memory, and
    per-sequence copies fragment the heap."""
    lengths = [len(seq) for seq in sequences]
    width = len(runner.tap_layers) * runner.config.hidden_size
    store = torch.empty(sum(lengths), width, dtype=dtype)  # [all sequences' tokens, n_taps * H]
    offset = 0
    for i in range(0, len(sequences), batch):
        chunk = sequences[i : i + batch]
        slots = [runner.cache.allocate() for _ in chunk]
        # last_only: the LM head over one row per sequence; the taps cover every row.
        rows = runner.forward([Segment(s, list(seq), last_only=True) for s, seq in zip(slots, chunk)]).tap_rows
        store[offset : offset + len(rows)] = rows
        offset += len(rows)
        for s in slots:
            runner.cache.release(s)
    return list(store.split(lengths))


class _Batcher:
    """Random anchors in the continuation part of the sequences; builds the drafter's training inputs."""

    def __init__(self, sequences, prompt_lens, features, block_size, rng: np.random.Generator) -> None:
        self.block_size, self.rng = block_size, rng
        # An anchor a needs labels a+1 .. a+B-1 inside the sequence, from the target's own continuation.
        self.items = [(seq, feat, p - 1) for seq, feat, p in zip(sequences, features, prompt_lens)
                      if len(seq) - block_size >= p - 1 >= 1]
        if not self.items:
            raise ValueError("no sequence is long enough for one block")

    def sample(self, n_seq: int, n_anchor: int):
        pick = self.rng.choice(len(self.items), size=min(n_seq, len(self.items)), replace=False)
        length = max(len(self.items[i][0]) for i in pick)
        feats = torch.zeros(len(pick), length, self.items[pick[0]][1].shape[-1])  # [b, S, n_taps * H], zero-padded
        seq_of, anchors, blocks = [], [], []
        for b, i in enumerate(pick):
            seq, feat, first = self.items[i]
            feats[b, : len(seq)] = feat
            for a in self.rng.integers(first, len(seq) - self.block_size + 1, size=n_anchor):
                seq_of.append(b)
                anchors.append(int(a))
                blocks.append(seq[a : a + self.block_size])
        return feats, torch.tensor(seq_of), torch.tensor(anchors), torch.tensor(blocks)  # blocks [R, B]: anchor + labels


def block_loss(model: DFlashDrafter, embedding, lm_head, cos, sin, batch, cfg: DistillConfig) -> tuple[torch.Tensor, dict]:
    feats, seq_of, anchors, blocks = batch
    dc = model.cfg
    S, B = feats.shape[1], dc.block_size
    ctx_h = model.context(feats)  # [b, S, H]
    layer_kv = [(k[seq_of], v[seq_of]) for k, v in model.context_kv(ctx_h, cos[None, None, :S], sin[None, None, :S])]
    visible = torch.arange(S)[None, :] < anchors[:, None]  # [R, S]: the context before the anchor
    positions = anchors[:, None] + torch.arange(B)  # [R, B]
    block_ids = torch.full_like(blocks, dc.mask_token_id)  # [R, B]: [anchor, MASK...]
    block_ids[:, 0] = blocks[:, 0]
    ctx = DrafterContext(layer_kv, visible, (cos[positions][:, None], sin[positions][:, None]), dc, positions)
    hidden = model(model.block_embeds(embedding, block_ids), ctx)[:, 1:]  # [R, B - 1, H]
    logits = model.draft_logits(hidden, lm_head)  # [R, B - 1, V]
    labels = blocks[:, 1:]  # [R, B - 1]
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / cfg.decay_gamma)  # slot k weight, k = 1..B-1
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss = (ce * weights).sum() / (weights.sum() * labels.shape[0])
    stats = {"ce": float(ce.detach().mean()), "top1": float((logits.argmax(-1) == labels).float().mean())}
    if dc.selector_rank:
        sel = model.candidate_selector
        unary, candidates = logits.topk(sel.top_k, dim=-1)  # [R, B - 1, top_k]
        hit = candidates == labels[..., None]
        found = hit.any(-1)
        scores = sel.scores(hidden, unary.detach(), candidates, blocks[:, :-1])  # true predecessor: teacher forcing
        if found.any():
            sel_loss = F.cross_entropy(scores[found], hit[found].float().argmax(-1))
            loss = loss + cfg.selector_loss_weight * sel_loss
            stats["selector"] = float(sel_loss.detach())
    return loss, stats


def train_drafter(
    target_dir: str | Path, out_dir: str | Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
    cfg: DistillConfig, progress: bool = True,
) -> DFlashDrafter:
    """Train on prepared supervision (prompt + greedy continuation), save to out_dir, return the drafter."""
    torch.manual_seed(cfg.seed)
    dcfg = drafter_config(target_dir, cfg)
    runner = Runner(load_checkpoint(target_dir), num_slots=8, max_len=max(len(s) for s in sequences) + 1,
                    tap_layers=dcfg.target_layer_ids)
    features = tap_features(runner, sequences, dtype=getattr(torch, cfg.feature_dtype))
    embedding, lm_head = runner.embedding.detach(), runner.lm_head.detach()
    model = DFlashDrafter(dcfg).train()
    if cfg.init_from:
        from blockspec.services.drafter.dflash.checkpoint import load_drafter

        model.load_state_dict(load_drafter(cfg.init_from).state_dict())
    cos, sin = rope_table(dcfg, runner.max_len + dcfg.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    batcher = _Batcher(sequences, prompt_lens, features, dcfg.block_size, np.random.default_rng(cfg.seed))
    bar = tqdm(range(cfg.steps), desc="train-drafter", disable=not progress)
    started, tokens = time.perf_counter(), 0
    loss = torch.zeros(())
    for _ in bar:
        batch = batcher.sample(cfg.batch_sequences, cfg.anchors_per_sequence)
        loss, stats = block_loss(model, embedding, lm_head, cos, sin, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += batch[3].numel()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{stats['top1']:.2f}", tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
    model.eval().requires_grad_(False)
    save_drafter(model, out_dir, {"blockspec_training": {"distill": {k: v for k, v in vars(cfg).items()},
                                                         "sequences": len(sequences), "final_loss": float(loss.detach()), **stats}})
    return model
