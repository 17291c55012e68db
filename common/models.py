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

# model_type -> family. The dense three differ only in biases and the q/k norm; the Qwen3.5 hybrids (text-only
# `qwen3_5_text`, multimodal `qwen3_5` whose text model is read and its vision tower left out) interleave Gated DeltaNet
# linear-attention layers with gated full-attention layers (`layer_types`).
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES
LAYER_TYPES = ("full_attention", "linear_attention")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
TOKENIZER_FILES = ("tokenizer.json",)


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's dimensions (`linear_*` keys of a Qwen3.5 config)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # the causal depthwise convolution's width; its state keeps conv_kernel - 1 inputs

    @property
    def conv_dim(self) -> int:  # channels through the convolution: q, k and v
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim


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
    # Hybrid models (HYBRID_MODEL_TYPES, `common/hybrid.py`): each layer's type, the Gated DeltaNet dimensions and
    # RoPE on the first rotary_dim of each head only.
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    linear: LinearAttention | None = None
    rotary_dim: int | None = None  # None: head_dim

    @property
    def hybrid(self) -> bool:
        return self.linear is not None

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache, in order."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent and a convolution state, in order."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "linear_attention")


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


def text_config(raw: dict) -> dict:
    """The language model's config: a multimodal Qwen3.5 checkpoint keeps it under `text_config`."""
    if raw.get("model_type") == "qwen3_5" and isinstance(raw.get("text_config"), dict):
        outer = {k: raw[k] for k in ("tie_word_embeddings",) if k in raw}
        return {**raw["text_config"], **outer, "model_type": "qwen3_5"}
    return raw


# Stored-name prefixes of what a multimodal or multi-token-prediction checkpoint holds beside the language model:
# left unread. The language model's own prefix becomes `model.`.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
TEXT_PREFIX = "model.language_model."


def _hybrid_fields(raw: dict, path: Path, num_layers: int, head_dim: int) -> dict:
    """The ModelConfig fields of a Qwen3.5 hybrid: layer types (or the interval they follow), the Gated DeltaNet
    dimensions, partial RoPE, the output gate."""
    where = str(path / "config.json")
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise ModelLoadError(where, f"layer_types: {len(types)} entries for {num_layers} layers"
                                    + (f", unknown types {unknown}" if unknown else "") + f"; known: {LAYER_TYPES}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(where, f"hidden_act {act!r} is not supported; supported: 'silu'")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if raw.get("attn_output_gate", True) is not True:
        raise ModelLoadError(where, "attn_output_gate=false is not supported (Qwen3.5 attention gates its output)")
    linear = LinearAttention(
        num_k_heads=int(_require(raw, "linear_num_key_heads", path)),
        num_v_heads=int(_require(raw, "linear_num_value_heads", path)),
        k_head_dim=int(_require(raw, "linear_key_head_dim", path)),
        v_head_dim=int(_require(raw, "linear_value_head_dim", path)),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ModelLoadError(where, f"linear_num_value_heads {linear.num_v_heads} is not a multiple of "
                                    f"linear_num_key_heads {linear.num_k_heads}")
    return {"layer_types": tuple(types), "linear": linear, "rotary_dim": int(head_dim * factor)}


def parse_config(raw: dict, path: Path) -> ModelConfig:
    """Validate an HF config dict for one of the supported families and turn it into a ModelConfig."""
    raw = text_config(raw)
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
    num_layers = int(_require(raw, "num_hidden_layers", path))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    hybrid = model_type in HYBRID_MODEL_TYPES
    if hybrid and attention_bias:
        raise ModelLoadError(str(path / "config.json"), "attention_bias=true is not supported for a hybrid model")
    return ModelConfig(
        family=model_type,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "llama" and attention_bias),
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3" or hybrid,
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=_eos_ids(raw, path),
        **(_hybrid_fields(raw, path, num_layers, head_dim) if hybrid else {}),
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
    """The language model's tensors of the checkpoint's safetensors files, by their stored names (a multimodal
    checkpoint's text model under `model.`; its vision tower and multi-token-prediction head left unread, with a
    log line)."""
    files = sorted(path.glob("*.safetensors"))
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
