"""The default pair's assistant: a small causal LM for the `draft_model` method and for transformers'
assisted generation, so both are measured with one draft model. It is trained on the target's own
greedy continuations (sequence-level distillation: the sequences that supervise the DFlash drafter),
resumably, with checkpoints.

CLI: blockspec build-assistant [--home DIR] [--work DIR] [--steps N] [--threads T]
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from blockspec.services.training.train_target import TrainConfig, export_hf, lr_factor, save_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AssistantConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    steps: int = 4000
    batch_sequences: int = 16
    peak_lr: float = 3e-3
    warmup_steps: int = 100
    heldout_sequences: int = 256  # the last ones: loss and next-token agreement with the target
    checkpoint_s: float = 300.0
    seed: int = 0


def assistant_config(target: Qwen3Config, cfg: AssistantConfig) -> Qwen3Config:
    """The target's vocabulary, special tokens and context; a fraction of its width and depth."""
    return Qwen3Config(
        vocab_size=target.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.hidden_size // 4,
        max_position_embeddings=target.max_position_embeddings, rope_parameters=target.rope_parameters,
        tie_word_embeddings=True, bos_token_id=target.bos_token_id, eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id)


def _rows(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [n, longest - 1]: next-token pairs, shorter sequences (stopped at end-of-sequence)
    padded, their padding labelled -100 (no loss)."""
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.int64)
    labels = torch.full((len(sequences), width - 1), -100, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = ids[i, 1 : len(seq)]
    return ids[:, :-1], labels


def _loss(model: Qwen3ForCausalLM, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), logits


@torch.no_grad()
def _heldout(model: Qwen3ForCausalLM, inputs: torch.Tensor, labels: torch.Tensor, prompt_len: int) -> dict[str, float]:
    """Loss and top-1 agreement with the target's greedy tokens, over the continuations of held-out rows."""
    model.eval()
    labels = labels.clone()
    labels[:, : prompt_len - 1] = -100  # the prompt is corpus text, not the target's choice
    losses, hits, total = [], 0, 0
    for x, y in zip(inputs.split(32), labels.split(32)):
        loss, logits = _loss(model, x, y)
        losses.append(loss.item())
        keep = y != -100
        hits += int((logits.argmax(-1) == y)[keep].sum())
        total += int(keep.sum())
    model.train()
    return {"heldout_loss": round(float(np.mean(losses)), 4), "heldout_agreement": round(hits / total, 4)}


def train_assistant(target: Path, out: Path, sequences: list[list[int]], prompt_len: int, cfg: AssistantConfig,
                    work: Path | None = None, progress: bool = True) -> dict:
    """Train on `sequences` (prompt_len prompt tokens, then the target's greedy continuation, up to its
    end-of-sequence token), the loss over every next token; write an HF checkpoint with the target's
    tokenizer to `out`. With `work`, a checkpoint there every cfg.checkpoint_s seconds; a rerun resumes."""
    target_cfg = Qwen3Config.from_pretrained(target)
    inputs, labels = _rows(sequences, target_cfg.eos_token_id)
    n_train = len(sequences) - cfg.heldout_sequences
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(assistant_config(target_cfg, cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = TrainConfig(peak_lr=cfg.peak_lr, warmup_steps=cfg.warmup_steps)
    rng, step, elapsed = np.random.default_rng(cfg.seed), 0, 0.0
    ckpt = work / "assistant.pt" if work else None
    if ckpt and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state, step, elapsed = state["numpy_rng"], state["step"], state["elapsed"]
        log.info("assistant: resumed at step %d of %d", step, cfg.steps)
    started, last_ckpt, loss = time.perf_counter() - elapsed, time.perf_counter(), float("nan")
    with tqdm(total=cfg.steps, initial=step, desc="assistant", disable=not progress) as bar:
        while step < cfg.steps:
            for group in opt.param_groups:
                group["lr"] = cfg.peak_lr * lr_factor(step, schedule, cfg.steps)
            rows = torch.from_numpy(rng.integers(0, n_train, size=cfg.batch_sequences))
            loss_t = _loss(model, inputs[rows], labels[rows])[0]
            opt.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step, loss = step + 1, loss_t.item()
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")
            if ckpt and time.perf_counter() - last_ckpt >= cfg.checkpoint_s:
                save_checkpoint(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                       "numpy_rng": rng.bit_generator.state, "elapsed": time.perf_counter() - started})
                last_ckpt = time.perf_counter()
    report = {"parameters": sum(p.numel() for p in model.parameters()), "steps": step, "train_loss": round(loss, 4),
              "sequences": n_train, "tokens_seen": step * cfg.batch_sequences * inputs.shape[1],
              "wall_time_s": round(time.perf_counter() - started, 1),
              **_heldout(model, inputs[n_train:], labels[n_train:], prompt_len),
              "config": asdict(cfg)}
    out.parent.mkdir(parents=True, exist_ok=True)
    export_hf(out, model, AutoTokenizer.from_pretrained(str(target)), report)
    log.info("assistant: %s", json.dumps({k: v for k, v in report.items() if k != "config"}))
    return report
