"""Train the default pair's Qwen3 target from scratch on CPU, resumably, and export it as an HF checkpoint.

CLI: python -m blockspec.services.training.train_target --out DIR --minutes M --threads T --seed S
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from blockspec.services.training import corpus, tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; everything here is stored in the checkpoint and in training.json."""

    seq_len: int = 512  # not much slower a token than 256, and the verifier sees longer contexts
    batch_size: int = 8  # 4096 tokens a step: thousands of steps in a two-hour build on one core
    peak_lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1  # cosine ends at 10% of peak at the planned last step
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    measure_steps: int = 30  # steps timed before the schedule length is fixed
    log_every: int = 50
    checkpoint_s: float = 300.0
    eval_s: float = 600.0
    eval_batches: int = 4  # fixed batches of batch_size sequences, held-out and train each
    eval_prompts: int = 8
    eval_new_tokens: int = 128


def model_config(vocab_size: int, eos_id: int) -> Qwen3Config:
    """4 layers x 256 hidden (~4M params): the run is compute-bound, and depth costs time per token."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def loop_share(token_ids: list[int], max_period: int = 16) -> float:
    """Fraction of tokens that lie inside a repetition loop of period <= max_period.

    A window of `L(p) = p * max(2, ceil(4 / p))` consecutive tokens is a loop of period p when
    every token in it equals the token p positions earlier within it (p tokens repeated at least
    twice, and at least 4 tokens long, so `))` alone is not a loop). A token is in a loop when
    some window that is a loop, of some period p <= max_period, contains it. 0.0 for no tokens.
    """
    n = len(token_ids)
    inside = [False] * n
    for p in range(1, max_period + 1):
        span = p * max(2, math.ceil(4 / p))
        run = 0  # consecutive positions i with token_ids[i] == token_ids[i - p]
        for i in range(p, n):
            run = run + 1 if token_ids[i] == token_ids[i - p] else 0
            if run >= span - p:
                for j in range(i - span + 1, i + 1):
                    inside[j] = True
    return sum(inside) / n if n else 0.0


def _encode_files(tok: PreTrainedTokenizerFast, files: list[corpus.CorpusFile]) -> np.ndarray:
    eos = tok.eos_token_id
    chunks: list[np.ndarray] = []
    texts = list(corpus.iter_texts(files))
    for start in range(0, len(texts), 256):
        for enc in tok.backend_tokenizer.encode_batch(texts[start : start + 256], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(chunks)


@dataclass(frozen=True)
class Data:
    """Tokenizer, token arrays (uint16, files joined by eos), corpus manifest and held-out prompts."""

    tok: PreTrainedTokenizerFast
    train: np.ndarray
    heldout: np.ndarray
    manifest: dict[str, object]
    prompts: list[str]


def prepare_data(out: Path, n_prompts: int) -> Data:
    """Build or load the tokenizer and the tokenized train / held-out splits.

    Everything is cached under `out/tokenizer` and `out/data`; a rerun loads the cache.
    """
    data = out / "data"
    files = corpus.all_files()
    train_files, heldout_files = corpus.split_files(files)
    tok = tokenizer.build_tokenizer(out / "tokenizer", train_files)
    arrays = []
    for name, split in (("train", train_files), ("heldout", heldout_files)):
        path = data / f"{name}.npy"
        if not path.exists():
            data.mkdir(parents=True, exist_ok=True)
            tmp = data / f"{name}.tmp.npy"
            np.save(tmp, _encode_files(tok, split))
            os.replace(tmp, path)
        arrays.append(np.load(path, mmap_mode="r"))
    manifest = corpus.manifest(files) | {"train_tokens": int(len(arrays[0])), "heldout_tokens": int(len(arrays[1]))}
    logger.info("data: %d train tokens, %d held-out tokens", len(arrays[0]), len(arrays[1]))
    return Data(tok, arrays[0], arrays[1], manifest, corpus.heldout_prompts(n_prompts, files))


def sample_batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len + 1] windows at uniform random offsets (inputs and shifted labels)."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def fixed_batches(tokens: np.ndarray, cfg: TrainConfig) -> list[torch.Tensor]:
    """Evaluation batches at evenly spaced offsets: the same every eval, every run."""
    count = cfg.eval_batches * cfg.batch_size
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 2, count).astype(np.int64)
    rows = [tokens[s : s + cfg.seq_len + 1].astype(np.int64) for s in starts]
    return [torch.from_numpy(np.stack(rows[i : i + cfg.batch_size])) for i in range(0, count, cfg.batch_size)]


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits  # [batch, seq, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def lr_factor(step: int, cfg: TrainConfig, planned_steps: int) -> float:
    """Linear warmup, then cosine from 1 down to final_lr_ratio at planned_steps (flat after)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, planned_steps - cfg.warmup_steps))
    return cfg.final_lr_ratio + (1 - cfg.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def greedy_stats(model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, prompts: list[str], new_tokens: int) -> dict:
    """Loop share and mean top-1 probability of plain greedy `generate` on the prompts."""
    generated: list[list[int]] = []
    top1: list[float] = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        generated.append(out.sequences[0, ids["input_ids"].shape[1] :].tolist())
        top1 += [torch.softmax(step_logits[0], -1).max().item() for step_logits in out.logits]
    total = sum(len(g) for g in generated)
    looped = sum(loop_share(g) * len(g) for g in generated)
    return {"loop_share": looped / max(1, total), "mean_top1_prob": float(np.mean(top1)) if top1 else 0.0,
            "sample": tok.decode(generated[0])[:300]}


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, heldout: list[torch.Tensor], train: list[torch.Tensor]) -> dict[str, float]:
    model.eval()
    result = {name: float(np.mean([lm_loss(model, b).item() for b in batches]))
              for name, batches in (("heldout_loss", heldout), ("train_eval_loss", train))}
    model.train()
    return result


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temporary file, then an atomic rename over the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export_hf(target: Path, model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, report: dict) -> None:
    """Write the HF checkpoint dir `target` (safetensors, tokenizer, greedy generation config, training.json)
    via a swap of dirs: a reader never sees half of it."""
    tmp, old = target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / "training.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


class Trainer:
    """One training run: owns the model, optimiser, sampler RNG and the resumable state."""

    def __init__(self, args: argparse.Namespace, cfg: TrainConfig) -> None:
        self.args, self.cfg, self.out = args, cfg, Path(args.out)
        data = prepare_data(self.out, cfg.eval_prompts)
        self.tok, self.train_tokens, self.heldout_tokens = data.tok, data.train, data.heldout
        self.manifest, self.prompts = data.manifest, data.prompts
        torch.manual_seed(args.seed)
        self.model = Qwen3ForCausalLM(model_config(len(self.tok), self.tok.eos_token_id))
        self.forward = torch.compile(self.model) if args.compile else self.model
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.peak_lr, betas=cfg.betas)
        self.rng = np.random.default_rng(args.seed)
        self.step, self.tokens_seen, self.elapsed, self.planned_steps = 0, 0, 0.0, 0
        self.history: list[dict] = []
        self.eval_s = 0.0  # measured cost of one eval, used when planning the schedule
        self.clock = (time.perf_counter(), 0.0)  # (session start, wall time trained before it)
        self.ckpt = self.out / "ckpt" / "state.pt"
        if self.ckpt.exists():
            self._restore(torch.load(self.ckpt, weights_only=False))
        self.heldout_batches = fixed_batches(self.heldout_tokens, cfg)
        self.train_batches = fixed_batches(self.train_tokens, cfg)

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                "tokens_seen": self.tokens_seen, "elapsed": self.elapsed, "planned_steps": self.planned_steps,
                "numpy_rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                "history": self.history, "eval_s": self.eval_s, "train_config": asdict(self.cfg)}

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["numpy_rng"]
        torch.set_rng_state(state["torch_rng"])
        self.step, self.tokens_seen, self.elapsed = state["step"], state["tokens_seen"], state["elapsed"]
        self.planned_steps, self.history, self.eval_s = state["planned_steps"], state["history"], state["eval_s"]
        logger.info("resumed at step %d of %d (%.0f s trained)", self.step, self.planned_steps, self.elapsed)

    def report(self) -> dict:
        """Everything training.json records about this run so far."""
        last = self.history[-1] if self.history else {}
        return {"parameters": sum(p.numel() for p in self.model.parameters()), "step": self.step,
                "planned_steps": self.planned_steps, "tokens_seen": self.tokens_seen,
                "wall_time_s": round(self.elapsed, 1), "train_loss": last.get("train_loss"),
                "train_eval_loss": last.get("train_eval_loss"), "heldout_loss": last.get("heldout_loss"),
                "loop_share": last.get("loop_share"), "mean_top1_prob": last.get("mean_top1_prob"),
                "evals": self.history, "corpus": self.manifest, "train_config": asdict(self.cfg),
                "model_config": self.model.config.to_dict(), "seed": self.args.seed,
                "threads": self.args.threads, "compile": self.args.compile, "finished": self.step >= self.planned_steps > 0}

    def train_step(self) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.peak_lr * lr_factor(self.step, self.cfg, self.planned_steps or 10**9)
        batch = sample_batch(self.train_tokens, self.rng, self.cfg.batch_size, self.cfg.seq_len)
        loss = lm_loss(self.forward, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.tokens_seen += batch[:, 1:].numel()
        return loss.item()

    def tick(self) -> None:
        """Advance `elapsed`: wall time of all sessions, evals and checkpoints included."""
        self.elapsed = self.clock[1] + time.perf_counter() - self.clock[0]

    def run_eval(self, train_loss: float | None) -> None:
        start = time.perf_counter()
        row = {"step": self.step, "tokens_seen": self.tokens_seen, "train_loss": train_loss}
        row |= evaluate(self.model, self.heldout_batches, self.train_batches)
        self.model.eval()
        row |= greedy_stats(self.model, self.tok, self.prompts, self.cfg.eval_new_tokens)
        self.model.train()
        self.eval_s = time.perf_counter() - start
        self.tick()
        row |= {"elapsed_s": round(self.elapsed, 1), "eval_s": round(self.eval_s, 1)}
        self.history.append(row)
        export_hf(self.out / "target", self.model, self.tok, self.report())
        logger.info(json.dumps({"event": "eval", **row}))

    def plan(self, step_s: float) -> None:
        """Fix the schedule length so that training, evals and checkpoints end when --minutes is up."""
        left = self.args.minutes * 60 - self.elapsed
        overhead = left / self.cfg.eval_s * (self.eval_s + 5.0) + left / self.cfg.checkpoint_s * 2.0
        self.planned_steps = self.step + max(1, int((left - overhead) / step_s))
        logger.info(json.dumps({"event": "plan", "step_s": round(step_s, 3), "planned_steps": self.planned_steps,
                                "planned_tokens": self.planned_steps * self.cfg.batch_size * self.cfg.seq_len,
                                "tokens_per_s": round(self.cfg.batch_size * self.cfg.seq_len / step_s, 1)}))

    def run(self) -> None:
        """The step loop: measure, plan, train; log, checkpoint and eval on wall-clock intervals."""
        self.clock = (time.perf_counter(), self.elapsed)
        if not self.history:
            self.run_eval(None)
        last_ckpt = last_eval = last_log = time.perf_counter()
        measure_from, measure_step, log_step, losses = None, 0, self.step, []
        while not self.planned_steps or self.step < self.planned_steps:
            losses.append(self.train_step())
            self.tick()
            if not self.planned_steps:  # skip 3 warm-up (and compile) steps, then time measure_steps
                if self.step == 3:
                    measure_from, measure_step = time.perf_counter(), self.step
                elif measure_from and self.step - measure_step == self.cfg.measure_steps:
                    self.plan((time.perf_counter() - measure_from) / self.cfg.measure_steps)
            now = time.perf_counter()
            if self.step % self.cfg.log_every == 0:
                tps = (self.step - log_step) * self.cfg.batch_size * self.cfg.seq_len / (now - last_log)
                logger.info(json.dumps({"event": "train", "step": self.step, "tokens_seen": self.tokens_seen,
                                        "train_loss": round(float(np.mean(losses[-self.cfg.log_every:])), 4),
                                        "tokens_per_s": round(tps, 1), "elapsed_s": round(self.elapsed, 1),
                                        "lr": self.opt.param_groups[0]["lr"]}))
                last_log, log_step = now, self.step
            if now - last_eval >= self.cfg.eval_s:
                self.run_eval(float(np.mean(losses[-self.cfg.log_every:])))
                last_eval = last_log = time.perf_counter()
                log_step = self.step
            if time.perf_counter() - last_ckpt >= self.cfg.checkpoint_s:
                save_checkpoint(self.ckpt, self._state())
                last_ckpt = last_log = time.perf_counter()
                log_step = self.step
        if not self.history or self.history[-1]["step"] != self.step:
            self.run_eval(float(np.mean(losses[-self.cfg.log_every:])) if losses else None)
        self.tick()
        save_checkpoint(self.ckpt, self._state())
        logger.info(json.dumps({"event": "done", **{k: v for k, v in self.report().items() if k not in
                                                    ("evals", "corpus", "model_config", "train_config")}}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="run directory; rerunning with it resumes")
    parser.add_argument("--minutes", type=float, required=True, help="training wall-clock budget (data prep excluded)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the training forward")
    parser.add_argument("--eval-minutes", type=float, default=TrainConfig.eval_s / 60)
    parser.add_argument("--checkpoint-minutes", type=float, default=TrainConfig.checkpoint_s / 60)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    cfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size,
                      eval_s=args.eval_minutes * 60, checkpoint_s=args.checkpoint_minutes * 60)
    Trainer(args, cfg).run()


if __name__ == "__main__":
    main()
