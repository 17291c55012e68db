"""`blockspec build-default`: the default target/drafter pair - `tiny` (under a minute, for tests) or
`base` (hours, resumable; the pair shipped in models/base) - and its model card."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from blockspec.services.training.assistant import AssistantConfig, train_assistant
from blockspec.services.training.distill import DistillConfig, continuations, train_drafter

log = logging.getLogger(__name__)

PROFILES = ("tiny", "base")
CARD = "card.json"
REPO_MODELS = Path(__file__).resolve().parents[2] / "models"


@dataclass(frozen=True)
class PairPaths:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def drafter_sampled(self) -> Path:
        """The drafter refined for requests that sample (stages 4-6, SAMPLED_STAGES): `--drafter` for chat traffic."""
        return self.root / "drafter-sampled"

    @property
    def assistant(self) -> Path:
        """An optional small causal LM (`build-assistant`): the `draft_model` method and transformers' assisted
        generation run with it."""
        return self.root / "assistant"

    @property
    def card(self) -> Path:
        return self.root / CARD

    def built(self) -> bool:
        return self.card.is_file() and (self.target / "config.json").is_file() and (self.drafter / "model.safetensors").is_file()


def default_home() -> Path:
    return Path(os.environ.get("BLOCKSPEC_HOME", REPO_MODELS))


def _tiny_target(out: Path, seed: int) -> list[int]:
    """A 2-layer Qwen3 trained for ~300 steps on two stdlib modules; returns the corpus token ids."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from blockspec.services.training.tiny import tiny_tokenizer
    from blockspec.services.training.train_target import lm_loss, sample_batch

    tok = tiny_tokenizer()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = np.asarray(tok.encode("\n".join((stdlib / n).read_text(encoding="utf-8") for n in ("textwrap.py", "string.py"))))
    eos = tok.eos_token_id
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    for _ in range(300):
        loss = lm_loss(model, sample_batch(ids, rng, 8, 64))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "training.json").write_text(json.dumps({"train_loss": float(loss.detach()), "tokens_seen": 300 * 8 * 64}))
    return ids.tolist()


def distill(target: Path, out: Path, token_ids, n_prompts: int, prompt_len: int, new_tokens: int,
            cfg: DistillConfig, progress: bool = True, prompt_seeds: tuple[int, ...] | None = None) -> None:
    """Prompts = random windows of `token_ids` (n_prompts per seed in `prompt_seeds`, default the config's
    seed); supervision = the target's continuations at the config's temperatures."""
    sequences = supervision(target, token_ids, n_prompts, prompt_len, new_tokens, prompt_seeds or (cfg.seed,), progress,
                            cfg.temperatures)
    train_drafter(target, out, sequences, [prompt_len] * len(sequences), cfg, progress)


def supervision(target: Path, token_ids, n_prompts: int, prompt_len: int, new_tokens: int,
                prompt_seeds: tuple[int, ...], progress: bool = True,
                temperatures: tuple[float, ...] = (0.0,)) -> list[list[int]]:
    """n_prompts random windows of `token_ids` per seed, each followed by the target's continuation (window i's at
    temperatures[i % n], 0: greedy)."""
    sequences = []
    for seed in prompt_seeds:
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(token_ids) - prompt_len, size=n_prompts)
        prompts = [[int(t) for t in token_ids[s : s + prompt_len]] for s in starts]
        sequences += cached_continuations(target, prompts, new_tokens, progress, temperatures, seed)
    return sequences


def cached_continuations(target: Path, prompts: list[list[int]], new_tokens: int, progress: bool = True,
                         temperatures: tuple[float, ...] = (0.0,), seed: int = 0) -> list[list[int]]:
    """`continuations`, cached on disk by (target weights, prompts, new_tokens, and where any is sampled the
    temperatures and seed): a rerun is cheap."""
    greedy = all(t == 0 for t in temperatures)
    key = hashlib.sha256(json.dumps([prompts, new_tokens] + ([] if greedy else [list(temperatures), seed])).encode())
    for f in sorted(Path(target).glob("*.safetensors")):
        key.update(f.read_bytes())
    cache = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec")) / "supervision"
    path = cache / f"{key.hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    sequences = continuations(target, prompts, new_tokens, batch=32, progress=progress, temperatures=temperatures,
                              seed=seed)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sequences))
    os.replace(tmp, path)
    return sequences


def build_tiny(paths: PairPaths, seed: int = 0) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    ids = _tiny_target(paths.target, seed)
    distill(paths.target, paths.drafter, ids, 64, 24, 64, DistillConfig(steps=200, seed=seed), progress=False)
    prompts = [ids[i : i + 16] for i in range(5, len(ids) - 16, max(1, len(ids) // 6))][:4]
    write_card(paths, prompts, max_tokens=64)


BASE_DISTILL = DistillConfig(steps=8000, intermediate_size=512, selector_rank=8, batch_sequences=8, anchors_per_sequence=16)
BASE_SUPERVISION = 8192  # prompts whose greedy continuations supervise the shipped drafter (per prompt seed)
# Stage 2: warm start from stage 1, twice the supervision (prompt seeds 0 and 1), a lower learning rate.
BASE_REFINE = replace(BASE_DISTILL, lr=1e-3, warmup_steps=50, seed=1, feature_dtype="float16")
# Stage 3: warm start from stage 2, four times the supervision (prompt seeds 0-3), half its learning rate.
BASE_STAGE3 = replace(BASE_REFINE, lr=5e-4, seed=2)
# Stages 4-6, for requests that sample (models/base/drafter-sampled), on the target's continuations of prompt seed 4,
# greedy and sampled at T 0.7 and 1.0 in turn. 4: warm start from stage 3, the soft term on the target's distribution
# at each drafted slot. 5: a second layer (it starts as the identity), the soft term weighed 3 over the target's top 64.
# 6: the path selector widened to 32 candidates and trained on the target's distribution over them too; requests
# that sample draw from the drafter's top 128 (sampling_top_k: written to the config, no bearing on the training).
SAMPLED_PROMPT_SEED = 4
BASE_SAMPLED = replace(BASE_STAGE3, temperatures=(0.0, 0.7, 1.0), kl_weight=1.0, seed=4, steps=3000)
BASE_SAMPLED_DEEP = replace(BASE_SAMPLED, num_layers=2, kl_weight=3.0, kl_top_k=64)
BASE_SAMPLED_SELECT = replace(BASE_SAMPLED_DEEP, selector_top_k=32, selector_kl_weight=1.5, lr=3e-4, steps=2500, seed=5,
                              sampling_top_k=128)
SAMPLED_STAGES = (BASE_SAMPLED, BASE_SAMPLED_DEEP, BASE_SAMPLED_SELECT)


def build_base(paths: PairPaths, work: Path, minutes: float, threads: int) -> None:
    """Train (or resume) the target in `work`, export it, distil the drafter, write the card, train the assistant."""
    from blockspec.services.training import corpus, train_target

    train_target.main(["--out", str(work), "--minutes", str(minutes), "--threads", str(threads)])
    paths.root.mkdir(parents=True, exist_ok=True)
    if paths.target.exists():
        shutil.rmtree(paths.target)
    shutil.copytree(work / "target", paths.target)
    train_ids = np.load(work / "data" / "train.npy", mmap_mode="r")
    distill(paths.target, paths.drafter, train_ids, BASE_SUPERVISION, 64, 128, BASE_DISTILL)
    distill(paths.target, paths.drafter, train_ids, BASE_SUPERVISION, 64, 128,
            replace(BASE_REFINE, init_from=str(paths.drafter)), prompt_seeds=(0, 1))
    distill(paths.target, paths.drafter, train_ids, BASE_SUPERVISION, 64, 128,
            replace(BASE_STAGE3, init_from=str(paths.drafter)), prompt_seeds=(0, 1, 2, 3))
    write_base_draft_vocab(paths, train_ids)
    distill_sampled(paths.target, paths.drafter, paths.drafter_sampled, train_ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(paths.target))
    prompts = corpus.heldout_prompts(16)
    (paths.root / "heldout_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    write_card(paths, [tok.encode(p) for p in prompts], max_tokens=128)
    build_assistant(paths, work, AssistantConfig(), threads)


def distill_sampled(target: Path, drafter: Path, out: Path, train_ids, first: int = 0) -> None:
    """Stages 4-6 (SAMPLED_STAGES[first:]) into `out`: each warm-starts from the one before (stage 4 from `drafter`,
    stage 3's), and `out` takes the drafter's draft vocabulary. A stage interrupted resumes from its saved state when
    run again with `first` at it."""
    for i, cfg in enumerate(SAMPLED_STAGES[first:], first):
        distill(target, out, train_ids, BASE_SUPERVISION, 64, 128, replace(cfg, init_from=str(drafter if i == 0 else out)),
                prompt_seeds=(SAMPLED_PROMPT_SEED,))
    shutil.copy(drafter / "draft_vocab.json", out / "draft_vocab.json")


def write_base_draft_vocab(paths: PairPaths, train_ids) -> dict:
    """The base drafter's draft vocabulary: half the target's vocabulary, the most frequent tokens of the
    target's training tokens (docs/models.md, "The DFlash-2 block drafter")."""
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter.dflash import draft_vocab

    config = load_checkpoint(paths.target, with_weights=False).config
    return draft_vocab.build(paths.drafter, config.vocab_size, config.eos_token_ids, [train_ids], None,
                             f"the target's {len(train_ids)} training tokens")


def build_assistant(paths: PairPaths, work: Path, cfg: AssistantConfig, threads: int, progress: bool = True) -> dict:
    """The base pair's assistant, trained on the drafter's supervision (prompt seeds 0-3: computed once,
    cached), its tau with the `draft_model` method added to the card (the card must exist)."""
    torch.set_num_threads(threads)
    train_ids = np.load(work / "data" / "train.npy", mmap_mode="r")
    sequences = supervision(paths.target, train_ids, BASE_SUPERVISION, 64, 128, (0, 1, 2, 3), progress)
    report = train_assistant(paths.target, paths.assistant, sequences, 64, cfg, work, progress)
    from blockspec.common.models.checkpoint import load_checkpoint

    tok = load_checkpoint(paths.target, with_weights=False).tokenizer
    prompts = [tok.encode(p) for p in (json.loads(line) for line in (paths.root / "heldout_prompts.jsonl").open())]
    card = json.loads(paths.card.read_text())
    card["assistant_parameters"] = report["parameters"]
    card["assistant_tau"] = [{k: v for k, v in measure(paths.target, paths.assistant, "draft_model", prompts, k, 128).items()
                              if k != "outputs"} for k in (3, 5)]
    paths.card.write_text(json.dumps(card, indent=2))
    return card


def measure(target: Path, drafter: Path | None, method: str, prompts: list[list[int]], k: int | None, max_tokens: int,
            **modules: bool) -> dict:
    """tau, acceptance and per-position acceptance of one method over the prompts (batched).
    `modules`: use_dynamic_conv / use_path_selector switches for dflash."""
    from blockspec.services.engine.engine import Engine

    engine = Engine(target, drafter, method, max_batch=len(prompts), threads=torch.get_num_threads(), **modules)
    done = engine.complete([engine.request(str(i), p, max_tokens, k) for i, p in enumerate(prompts)])
    steps, drafted, accepted = (sum(getattr(e.stats, a) for e in done) for a in ("steps", "drafted", "accepted"))
    per_pos = np.sum([np.pad(e.stats.accepted_per_pos, (0, (k or 0) - len(e.stats.accepted_per_pos))) for e in done], axis=0)
    return {"method": method, "k": k, "tau": round(1 + accepted / steps, 3) if steps else 0.0,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_pos": [int(x) for x in np.atleast_1d(per_pos)], "steps": steps,
            "outputs": [list(e.token_ids) for e in done]}


def write_card(paths: PairPaths, prompts: list[list[int]], max_tokens: int) -> dict:
    """Measure the pair on held-out prompts and write card.json (what `blockspec info` prints)."""
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter.dflash.checkpoint import load_drafter
    from blockspec.services.training.train_target import loop_share

    target, drafter = load_checkpoint(paths.target), load_drafter(paths.drafter)
    target_params = sum(w.numel() for w in target.weights.values())
    drafter_params = sum(p.numel() for p in drafter.parameters())
    rows = [measure(paths.target, paths.drafter, "dflash", prompts, k, max_tokens) for k in (3, 5, 7) if k <= drafter.cfg.max_k]
    rows.append(measure(paths.target, None, "ngram", prompts, 5, max_tokens))
    ablation = []
    for conv, selector in ((False, False), (True, False), (False, True), (True, True)):
        row = measure(paths.target, paths.drafter, "dflash", prompts, 5, max_tokens, use_dynamic_conv=conv,
                      use_path_selector=selector)
        ablation.append({"dynamic_conv": conv, "path_selector": selector, **row})
    outputs = rows[-1].pop("outputs")
    for row in rows + ablation:
        row.pop("outputs", None)
    training = json.loads((paths.target / "training.json").read_text()) if (paths.target / "training.json").is_file() else {}
    card = {
        "target_parameters": target_params,
        "drafter_parameters": drafter_params,  # its own weights: embedding and LM head are the target's
        "drafter_share_of_target": round(drafter_params / target_params, 4),
        "training_tokens": training.get("tokens_seen"),
        "heldout_loss": training.get("heldout_loss"),
        "loop_share": round(float(np.mean([loop_share(o) for o in outputs])), 4),
        "eval_prompts": len(prompts),
        "max_tokens": max_tokens,
        "tau": rows,
        "ablation_k5": ablation,  # modules switched off at inference on the same trained drafter
        "drafter_config": drafter.cfg.to_hf()["dflash_config"],
    }
    from blockspec.services.drafter.dflash import draft_vocab

    if drafter.draft_vocab is not None and draft_vocab.enabled():  # measured with it, as the engine runs the drafter
        info = draft_vocab.read(paths.drafter)
        card["draft_vocab"] = {"size": len(drafter.draft_vocab), "vocab_size": drafter.cfg.vocab_size,
                               **{k: info.get(k) for k in ("source", "coverage")}}
    paths.card.write_text(json.dumps(card, indent=2))
    return card


def build_default(profile: str, home: Path | None = None, work: Path | None = None, minutes: float = 125,
                  threads: int = 2) -> PairPaths:
    """Build the pair unless it is already there; returns its paths."""
    paths = PairPaths((home or default_home()) / profile)
    if paths.built():
        return paths
    torch.set_num_threads(threads)
    if profile == "tiny":
        build_tiny(paths)
    else:
        build_base(paths, work or Path(".cache/default-pair/base"), minutes, threads)
    return paths
