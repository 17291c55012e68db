"""Loading a causal LM from a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from blockspec.common.errors import ModelLoadError

log = logging.getLogger(__name__)

# model_type -> family; the three families differ only in biases and the q/k norm.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
TOKENIZER_FILES = ("tokenizer.json",)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the runner needs, read from config.json."""

    family: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # qwen2 always, llama when attention_bias
    o_bias: bool  # llama when attention_bias
    mlp_bias: bool  # llama when mlp_bias
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_theta: float
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling parameters, sorted items
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint directory: its config, weights (HF names) and tokenizer."""

    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object  # transformers PreTrainedTokenizerFast


def _require(raw: dict, key: str, path: Path) -> object:
    if key not in raw:
        raise ModelLoadError(str(path / "config.json"), f"missing key {key!r}")
    return raw[key]


def _rope(raw: dict, path: Path) -> tuple[float, tuple[tuple[str, float], ...]]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            str(path / "config.json"),
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return theta, ()
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, tuple((k, float(params[k])) for k in keys)


def _eos_ids(raw: dict, path: Path) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_config(raw: dict, path: Path) -> ModelConfig:
    """Validate an HF config dict for one of the supported families and turn it into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        raise ModelLoadError(
            str(path),
            f"unsupported architecture (model_type={model_type!r}, architectures={archs}); "
            f"expected one of model_type {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    if raw.get("use_sliding_window"):
        raise ModelLoadError(str(path / "config.json"), "use_sliding_window=true is not supported")
    hidden = int(_require(raw, "hidden_size", path))
    heads = int(_require(raw, "num_attention_heads", path))
    theta, scaling = _rope(raw, path)
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=model_type,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=int(_require(raw, "num_hidden_layers", path)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "llama" and attention_bias),
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=_eos_ids(raw, path),
    )


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
    """All tensors of the checkpoint's safetensors files, by their stored names."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(f.name for f in path.glob("*.bin")) or ["nothing"]
        raise ModelLoadError(str(path), f"no *.safetensors weights (found {', '.join(found)}); save with safetensors")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name)
        except (SafetensorError, OSError) as e:  # truncated, corrupt or unreadable: name the file, not a traceback
            raise ModelLoadError(str(f), f"cannot read the weights ({e})") from None
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
    weights = load_weights(p) if with_weights else {}
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
