"""Distil a DFlash-2 drafter from a target: sequence-level distillation on the target's own continuations (greedy,
or sampled at the temperatures requests use), random anchors, decay-weighted block cross-entropy, a soft term on the
target's distribution at each drafted slot (KL(p || q), from its top tokens), plus the path selector's loss (on the
continuation's token, and optionally on the target's distribution over the selector's candidates); the
training state saved every `checkpoint_every` steps, so that a rerun resumes."""

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

from blockspec.common.models.checkpoint import load_checkpoint, read_config
from blockspec.common.models.decoder import rope_table
from blockspec.common.runtime.runner import Runner, Segment
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
    sampling_top_k: int | None = None  # for the config: a sampling walk's candidates (None: selector_top_k)
    anchors_per_sequence: int = 16
    batch_sequences: int = 8
    steps: int = 400
    lr: float = 3e-3
    warmup_steps: int = 20
    decay_gamma: float = 4.0  # slot weight exp(-(k - 1) / gamma): later slots matter less
    selector_loss_weight: float = 0.5
    seed: int = 0
    init_from: str | None = None  # warm start from this drafter checkpoint: a refinement stage (layers may be added)
    feature_dtype: str = "float32"  # tap features kept in memory as this ("float16" halves a large run's RAM)
    # The supervision: continuation i is the target's at temperatures[i % n] (0: greedy), seeded by (seed, i).
    temperatures: tuple[float, ...] = (0.0,)
    kl_weight: float = 0.0  # weight of the soft term: cross-entropy to the target's distribution at each slot
    kl_temperature: float = 1.0  # the target's distribution for that term: softmax(logits / this)
    kl_top_k: int = 32  # kept per position: the target's top tokens and their probabilities (renormalised)
    selector_kl_weight: float = 0.0  # the selector's soft term: cross-entropy to that distribution over its candidates
    selector_only: bool = False  # train the path selector only, the drafter's layers as init_from left them
    checkpoint_every: int = 250  # steps between saves of the training state (out_dir/train_state.pt)


def default_taps(num_layers: int, n: int = 3) -> tuple[int, ...]:
    """n layer ids spread from the first layer to the last."""
    return tuple(sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)}))


def drafter_config(target_dir: str | Path, cfg: DistillConfig) -> DFlashConfig:
    """The drafter's config for the target; a refinement (init_from) keeps its drafter's taps and their reading."""
    target = load_checkpoint(target_dir)
    t = target.config
    init = DFlashConfig.from_hf(read_config(cfg.init_from), cfg.init_from) if cfg.init_from else None
    taps = cfg.target_layer_ids or (tuple(sorted(set(init.target_layer_ids))) if init else default_taps(t.num_layers))
    return DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=cfg.intermediate_size or t.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=t.hidden_size // cfg.num_heads,
        vocab_size=t.vocab_size, num_target_layers=t.num_layers,
        target_layer_ids=taps, block_size=cfg.block_size,
        mask_token_id=target.tokenizer.mask_token_id, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k, short_blocks=True,  # greedy drafts of k + 1 slots: see docs/models.md
        sampling_top_k=cfg.sampling_top_k, last_tap_before_norm=bool(init and init.last_tap_before_norm),
    )


def continuations(target_dir: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int = 16,
                  progress: bool = True, temperatures: Sequence[float] = (0.0,), seed: int = 0) -> list[list[int]]:
    """The supervision: prompt + the target's own continuation, for every prompt; prompt i's sampled at
    temperatures[i % n] (0: greedy) with the seed (seed, i), so that the same arguments give the same sequences."""
    from blockspec.common.sampling import SamplingParams
    from blockspec.services.engine.engine import Engine

    engine = Engine(target_dir, None, "none", max_batch=batch, max_len=max(len(p) for p in prompts) + new_tokens,
                    threads=torch.get_num_threads())
    requests = [engine.request(str(i), p, new_tokens, sampling=SamplingParams(
        temperature=temperatures[i % len(temperatures)], seed=(seed << 32) + i)) for i, p in enumerate(prompts)]
    with tqdm(total=len(prompts), desc="target continuations", unit="seq", disable=not progress) as bar:
        done = engine.complete(requests, on_finish=lambda _: bar.update())
    return [list(r.prompt_ids) + list(e.token_ids) for r, e in zip(requests, done)]


@torch.inference_mode()
def tap_features(runner: Runner, sequences: Sequence[Sequence[int]], batch: int = 8,
                 dtype: torch.dtype = torch.float32, top_k: int = 0, temperature: float = 1.0):
    """Target tap features [len, n_taps * H] of every position of every sequence: views of one tensor of
    `dtype`, filled batch by batch: per-batch fp32 results kept until the end take far more memory, and
    per-sequence copies fragment the heap. top_k > 0: also the target's next-token distribution at every position
    (softmax(logits / temperature)) as its top_k ids [len, top_k] and probabilities [len, top_k] (fp16, renormalised);
    returns (features, ids, probs), each a list over the sequences."""
    lengths = [len(seq) for seq in sequences]
    width = len(runner.tap_layers) * runner.config.hidden_size
    store = torch.empty(sum(lengths), width, dtype=dtype)  # [all sequences' tokens, n_taps * H]
    ids = torch.empty(sum(lengths), top_k, dtype=torch.int32) if top_k else None
    probs = torch.empty(sum(lengths), top_k, dtype=torch.float16) if top_k else None
    offset = 0
    for i in range(0, len(sequences), batch):
        chunk = sequences[i : i + batch]
        slots = [runner.cache.allocate() for _ in chunk]
        # last_only without top_k: the LM head over one row per sequence; the taps cover every row.
        out = runner.forward([Segment(s, list(seq), last_only=not top_k) for s, seq in zip(slots, chunk)])
        rows = out.tap_rows
        store[offset : offset + len(rows)] = rows
        if top_k:
            p, j = torch.softmax(torch.cat(out.logits) / temperature, dim=-1).topk(top_k, dim=-1)
            ids[offset : offset + len(rows)] = j
            probs[offset : offset + len(rows)] = p / p.sum(-1, keepdim=True)
        offset += len(rows)
        for s in slots:
            runner.cache.release(s)
    if not top_k:
        return list(store.split(lengths))
    return list(store.split(lengths)), list(ids.split(lengths)), list(probs.split(lengths))


class _Batcher:
    """Random anchors in the continuation part of the sequences; builds the drafter's training inputs."""

    def __init__(self, sequences, prompt_lens, features, block_size, rng: np.random.Generator, soft=None) -> None:
        self.block_size, self.rng = block_size, rng
        # An anchor a needs labels a+1 .. a+B-1 inside the sequence, from the target's own continuation.
        soft = list(zip(*soft)) if soft is not None else [None] * len(sequences)  # per sequence: (ids, probs)
        self.items = [(seq, feat, p - 1, s) for seq, feat, p, s in zip(sequences, features, prompt_lens, soft)
                      if len(seq) - block_size >= p - 1 >= 1]
        if not self.items:
            raise ValueError("no sequence is long enough for one block")

    def sample(self, n_seq: int, n_anchor: int):
        pick = self.rng.choice(len(self.items), size=min(n_seq, len(self.items)), replace=False)
        length = max(len(self.items[i][0]) for i in pick)
        feats = torch.zeros(len(pick), length, self.items[pick[0]][1].shape[-1])  # [b, S, n_taps * H], zero-padded
        seq_of, anchors, blocks, soft_ids, soft_p = [], [], [], [], []
        for b, i in enumerate(pick):
            seq, feat, first, soft = self.items[i]
            feats[b, : len(seq)] = feat
            for a in self.rng.integers(first, len(seq) - self.block_size + 1, size=n_anchor):
                seq_of.append(b)
                anchors.append(int(a))
                blocks.append(seq[a : a + self.block_size])
                if soft is not None:  # slot k's label is token a + k: the target's distribution at position a + k - 1
                    soft_ids.append(soft[0][a : a + self.block_size - 1])
                    soft_p.append(soft[1][a : a + self.block_size - 1])
        soft = (torch.stack(soft_ids).long(), torch.stack(soft_p).float()) if soft_ids else None  # [R, B - 1, K]
        # blocks [R, B]: anchor + labels
        return feats, torch.tensor(seq_of), torch.tensor(anchors), torch.tensor(blocks), soft


def draft_block(model: DFlashDrafter, embedding, lm_head, cos, sin, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's forward over a batch's blocks [anchor, MASK...] -> (hidden, logits) of the draft slots
    [R, B - 1, H] and [R, B - 1, V]."""
    feats, seq_of, anchors, blocks, _ = batch
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
    return hidden, model.draft_logits(hidden, lm_head)


def block_loss(model: DFlashDrafter, embedding, lm_head, cos, sin, batch, cfg: DistillConfig) -> tuple[torch.Tensor, dict]:
    _, _, _, blocks, soft = batch
    B = model.cfg.block_size
    hidden, logits = draft_block(model, embedding, lm_head, cos, sin, batch)
    labels = blocks[:, 1:]  # [R, B - 1]
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / cfg.decay_gamma)  # slot k weight, k = 1..B-1
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss = (ce * weights).sum() / (weights.sum() * labels.shape[0])
    stats = {"ce": float(ce.detach().mean()), "top1": float((logits.argmax(-1) == labels).float().mean())}
    if cfg.kl_weight and soft is not None:  # cross-entropy to the target's distribution: KL(p || q) + H(p)
        ids, p = soft
        log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, ids)  # [R, B - 1, K]
        soft_ce = -(p * log_q).sum(-1)
        loss = loss + cfg.kl_weight * (soft_ce * weights).sum() / (weights.sum() * labels.shape[0])
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
        stats["kl"] = float((soft_ce - entropy).detach().mean())
    if model.cfg.selector_rank:
        sel = model.candidate_selector
        unary, candidates = logits.topk(sel.top_k, dim=-1)  # [R, B - 1, top_k]
        hit = candidates == labels[..., None]
        found = hit.any(-1)
        scores = sel.scores(hidden, unary.detach(), candidates, blocks[:, :-1])  # true predecessor: teacher forcing
        if found.any():
            sel_loss = F.cross_entropy(scores[found], hit[found].float().argmax(-1))
            loss = loss + cfg.selector_loss_weight * sel_loss
            stats["selector"] = float(sel_loss.detach())
        if cfg.selector_kl_weight and soft is not None:  # and to the target's distribution over the candidates
            ids, p = soft
            on = (candidates[..., :, None] == ids[..., None, :]).float() @ p[..., None]  # [R, B - 1, top_k, 1]
            on = on.squeeze(-1)
            mass = on.sum(-1, keepdim=True)
            kept = mass.squeeze(-1) > 0
            soft_sel = -((on / mass.clamp_min(1e-12)) * F.log_softmax(scores, dim=-1)).sum(-1)[kept].mean()
            loss = loss + cfg.selector_kl_weight * soft_sel
            stats["selector_soft"] = float(soft_sel.detach())
    return loss, stats


def train_drafter(
    target_dir: str | Path, out_dir: str | Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
    cfg: DistillConfig, progress: bool = True,
) -> DFlashDrafter:
    """Train on prepared supervision (prompt + the target's continuation), save to out_dir, return the drafter. Every
    cfg.checkpoint_every steps the training state (weights, optimiser, schedule, random streams) goes to
    out_dir/train_state.pt; a rerun with the same config and supervision continues from it, and ends with the drafter
    the uninterrupted run would have given."""
    torch.manual_seed(cfg.seed)
    dcfg = drafter_config(target_dir, cfg)
    runner = Runner(load_checkpoint(target_dir), num_slots=8, max_len=max(len(s) for s in sequences) + 1,
                    tap_layers=dcfg.tap_points)
    top_k = cfg.kl_top_k if cfg.kl_weight or cfg.selector_kl_weight else 0
    taps = tap_features(runner, sequences, dtype=getattr(torch, cfg.feature_dtype), top_k=top_k,
                        temperature=cfg.kl_temperature)
    features, soft = (taps[0], taps[1:]) if top_k else (taps, None)
    embedding, lm_head = runner.embedding.detach(), runner.lm_head.detach()
    model = DFlashDrafter(dcfg).train()
    if cfg.init_from:
        warm_start(model, cfg.init_from)
    cos, sin = rope_table(dcfg, runner.max_len + dcfg.block_size)
    if cfg.selector_only:
        if not (cfg.init_from and dcfg.selector_rank):
            raise ValueError("selector_only trains the path selector of a drafter it starts from (init_from)")
        model.requires_grad_(False)
        model.candidate_selector.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    batcher = _Batcher(sequences, prompt_lens, features, dcfg.block_size, np.random.default_rng(cfg.seed), soft)
    state_file = Path(out_dir) / "train_state.pt"
    identity = {"config": repr(cfg), "supervision": _digest(sequences, prompt_lens)}
    first = _resume(state_file, identity, model, opt, sched, batcher)
    bar = tqdm(range(first, cfg.steps), desc="train-drafter", disable=not progress, initial=first, total=cfg.steps)
    started, tokens = time.perf_counter(), 0
    loss, stats = torch.zeros(()), {}
    for step in bar:
        batch = batcher.sample(cfg.batch_sequences, cfg.anchors_per_sequence)
        loss, stats = block_loss(model, embedding, lm_head, cos, sin, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += batch[3].numel()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{stats['top1']:.2f}", tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            _save_state(state_file, identity, step + 1, model, opt, sched, batcher)
    model.eval().requires_grad_(False)
    save_drafter(model, out_dir, {"blockspec_training": {"distill": {k: v for k, v in vars(cfg).items()},
                                                         "sequences": len(sequences), "final_loss": float(loss.detach()), **stats}})
    state_file.unlink(missing_ok=True)
    return model


@torch.no_grad()
def warm_start(model: DFlashDrafter, source: str | Path) -> None:
    """Load the drafter at `source` into `model`, which may have more layers: the source's layers come first, and
    each added layer starts as the identity (its attention and MLP output projections zero), so the grown drafter
    drafts exactly as the source did before its first step. Any other difference in shape is refused."""
    from blockspec.services.drafter.dflash.checkpoint import load_drafter

    old = load_drafter(source)
    if old.cfg.num_layers > model.cfg.num_layers:
        raise ValueError(f"{source}: {old.cfg.num_layers} layers; cannot start a drafter of {model.cfg.num_layers}")
    if old.cfg.tap_points != model.cfg.tap_points:
        raise ValueError(f"{source}: it reads the target's taps {old.cfg.tap_points}, this drafter "
                         f"{model.cfg.tap_points} (target_layer_ids)")
    missing, unexpected = model.load_state_dict(old.state_dict(), strict=False)
    added = {f"layers.{i}." for i in range(old.cfg.num_layers, model.cfg.num_layers)}
    if unexpected or any(not any(k.startswith(a) for a in added) for k in missing):
        raise ValueError(f"{source}: its weights do not fit this drafter (missing {missing}, unexpected {unexpected})")
    for layer in model.layers[old.cfg.num_layers:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def _digest(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps([list(map(list, sequences)), list(prompt_lens)]).encode()).hexdigest()


def _save_state(path: Path, identity: dict, step: int, model, opt, sched, batcher: _Batcher) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({**identity, "step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "batcher_rng": batcher.rng.bit_generator.state,
                "torch_rng": torch.get_rng_state()}, tmp)
    tmp.replace(path)  # whole or not at all: a kill mid-save leaves the previous state


def _resume(path: Path, identity: dict, model, opt, sched, batcher: _Batcher) -> int:
    """The step to start from: a saved state's, where it belongs to this config and supervision (else 0)."""
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=False)
    if {k: state.get(k) for k in identity} != identity:
        log.warning("%s belongs to another config or supervision: training from the start", path)
        return 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    batcher.rng.bit_generator.state = state["batcher_rng"]
    torch.set_rng_state(state["torch_rng"])
    log.info("resuming %s at step %d", path, state["step"])
    return state["step"]
