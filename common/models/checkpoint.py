"""Loading a causal LM from a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.model_config import ModelConfig, parse_config

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json",)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint directory: its config, weights (HF names) and tokenizer."""

    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object  # transformers PreTrainedTokenizerFast


# Stored-name prefixes of what a multimodal or multi-token-prediction checkpoint holds beside the language model:
# left unread. The language model's own prefix becomes `model.`.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
TEXT_PREFIX = "model.language_model."


def _checkpoint_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(str(p), "checkpoint directory not found")
    if not p.is_dir():
        raise ModelLoadError(str(p), "expected a checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    if not (p / "config.json").is_file():
        raise ModelLoadError(str(p), "no config.json in the checkpoint directory")
    return p


def read_config(path: str | Path) -> dict:
    """The raw config.json of a checkpoint directory, after checking the directory exists."""
    p = _checkpoint_dir(path)
    try:
        return json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(str(p / "config.json"), f"not valid JSON ({e})") from e


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The language model's tensors of the checkpoint's safetensors files, by their stored names (a multimodal
    checkpoint's text model under `model.`; its vision tower and multi-token-prediction head left unread, with a
    log line)."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every shard its index names must be there
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(str(index), f"not a safetensors index (weight_map: {e})") from None
        missing = [f for f in shards if not (path / f).is_file()]
        if missing:
            raise ModelLoadError(str(index), f"weight_map names {len(missing)} shard(s) not in the directory: "
                                             f"{', '.join(missing[:3])}")
    if not files:
        found = sorted(f.name for f in path.glob("*.bin")) or ["nothing"]
        raise ModelLoadError(str(path), f"no *.safetensors weights (found {', '.join(found)}); save with safetensors")
    weights: dict[str, torch.Tensor] = {}
    skipped: dict[str, int] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    prefix = next((p for p in SKIPPED_PREFIXES if name.startswith(p)), None)
                    if prefix is not None:
                        skipped[prefix] = skipped.get(prefix, 0) + 1
                        continue
                    key = "model." + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name
                    weights[key] = st.get_tensor(name)
        except (SafetensorError, OSError) as e:  # truncated, corrupt or unreadable: name the file, not a traceback
            raise ModelLoadError(str(f), f"cannot read the weights ({e})") from None
    for prefix, count in skipped.items():
        log.info("%s: %d tensors under %s left unread (not the language model)", path, count, prefix)
    return weights


def unfuse_qwen3_next(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's linear layers keep q, k, v, z in one projection and b, a in another, grouped per key head
    ([q_g, k_g, v_g, z_g] rows for key head g; [b_g, a_g]); the same maths as Qwen3.5's in_proj_qkv / _z / _b / _a,
    which this rewrites them into (the rows reordered, nothing computed)."""
    lin = cfg.linear
    per = lin.num_v_heads // lin.num_k_heads  # value heads per key head
    qkvz_split = (lin.k_head_dim, lin.k_head_dim, per * lin.v_head_dim, per * lin.v_head_dim)
    for layer in cfg.linear_layers:
        prefix = f"model.layers.{layer}.linear_attn."
        qkvz = weights.pop(prefix + "in_proj_qkvz.weight", None)
        ba = weights.pop(prefix + "in_proj_ba.weight", None)
        if qkvz is None or ba is None:
            continue  # left to the name check, which names what is missing
        q, k, v, z = qkvz.view(lin.num_k_heads, sum(qkvz_split), -1).split(qkvz_split, dim=1)
        b, a = ba.view(lin.num_k_heads, 2 * per, -1).split((per, per), dim=1)
        flat = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]  # key-head-major rows
        weights[prefix + "in_proj_qkv.weight"] = torch.cat(flat[:3])
        weights[prefix + "in_proj_z.weight"], weights[prefix + "in_proj_b.weight"] = flat[3], flat[4]
        weights[prefix + "in_proj_a.weight"] = flat[5]
    return weights


def load_tokenizer(path: Path) -> object:
    """The checkpoint's fast tokenizer; the directory must hold tokenizer.json."""
    missing = [f for f in TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelLoadError(str(path), f"missing tokenizer file(s): {', '.join(missing)}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_checkpoint(path: str | Path, with_weights: bool = True) -> Checkpoint:
    """Load config, weights and tokenizer of a Llama / Qwen2 / Qwen3 checkpoint directory.
    `with_weights=False`: config and tokenizer only (a role that needs to know the target, not run it)."""
    p = _checkpoint_dir(path)
    config = parse_config(read_config(p), p)
    tokenizer = load_tokenizer(p)
    if len(tokenizer) > config.vocab_size:  # ids past the embedding: the first such token would fail mid-request
        raise ModelLoadError(str(p / "tokenizer.json"), f"{len(tokenizer)} tokens (with the added ones) do not fit "
                                                        f"config.json's vocab_size {config.vocab_size}")
    weights = load_weights(p) if with_weights else {}
    if config.family == "qwen3_next" and weights:
        weights = unfuse_qwen3_next(weights, config)
    log.info("loaded %s checkpoint %s (%d tensors)", config.family, p, len(weights))
    return Checkpoint(path=p, config=config, weights=weights, tokenizer=tokenizer)


def check_same_tokenizer(target: Checkpoint, drafter: Checkpoint) -> None:
    """Refuse a drafter whose tokenizer maps text to different ids than the target's, saying how."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    problems = []
    if len(t_vocab) != len(d_vocab):
        problems.append(f"vocabulary sizes {len(d_vocab)} (drafter) vs {len(t_vocab)} (target)")
    differing = sorted(tok for tok, i in d_vocab.items() if t_vocab.get(tok) != i)
    if differing:
        examples = ", ".join(f"{tok!r}: {d_vocab[tok]} vs {t_vocab.get(tok)}" for tok in differing[:3])
        problems.append(f"{len(differing)} tokens map to different ids (e.g. {examples})")
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        t, d = getattr(target.tokenizer, name, None), getattr(drafter.tokenizer, name, None)
        if t != d:
            problems.append(f"{name} {d!r} vs {t!r}")
    if drafter.config.vocab_size > target.config.vocab_size:  # padded logits: it could draft ids the target lacks
        problems.append(f"its logits cover {drafter.config.vocab_size} ids, the target's {target.config.vocab_size}")
    if problems:
        raise ModelLoadError(
            str(drafter.path), f"drafter tokenizer differs from the target's ({target.path}): " + "; ".join(problems)
        )
