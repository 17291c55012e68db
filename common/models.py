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
# The MoE variants (`qwen3_moe`; `qwen3_5_moe` and its text-only `qwen3_5_moe_text`) replace the MLP with routed
# experts (and, in Qwen3.5, a gated shared expert). Qwen3-Next (`qwen3_next`) has the Qwen3.5 MoE's layers with the
# linear layers' q, k, v, z and b, a projections fused per key head (`unfuse_qwen3_next`).
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # their language model's config is `text_config`
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
class Experts:
    """A mixture-of-experts MLP: each token's top_k experts of num_experts (softmax over the router's logits, the
    top_k weights renormalised to sum 1 where norm_topk_prob), plus a shared expert gated by sigmoid where
    shared_intermediate_size is set."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # layers with the plain MLP instead (`mlp_only_layers`, `decoder_sparse_step`)


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
    experts: Experts | None = None  # MoE models

    def sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is the mixture of experts."""
        return self.experts is not None and layer not in self.experts.dense_layers

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


def rope_settings(raw: dict, where: str) -> tuple[float, tuple[tuple[str, float], ...]]:
    """RoPE theta and scaling parameters from a config's `rope_parameters` (or older `rope_scaling`) and
    `rope_theta`; a rope type other than SUPPORTED_ROPE_TYPES is refused, naming the file `where`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(where, f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
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
    if raw.get("model_type") in MULTIMODAL_MODEL_TYPES and isinstance(raw.get("text_config"), dict):
        outer = {k: raw[k] for k in ("tie_word_embeddings",) if k in raw}
        return {**raw["text_config"], **outer, "model_type": raw["model_type"]}
    return raw


def _experts(raw: dict, path: Path, model_type: str, num_layers: int) -> Experts | None:
    """The MoE fields of a qwen3_moe / qwen3_5_moe config (None for the others)."""
    if model_type not in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"):
        return None
    where = str(path / "config.json")
    if "num_experts" not in raw and "num_local_experts" in raw:  # the name transformers 5 saves
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    num_experts = int(_require(raw, "num_experts", path))
    if model_type in ("qwen3_moe", "qwen3_next"):  # routed where decoder_sparse_step / mlp_only_layers say
        step = int(raw.get("decoder_sparse_step", 1))
        only = set(raw.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only or num_experts == 0 or (i + 1) % step)
        norm = bool(raw.get("norm_topk_prob", model_type == "qwen3_next"))
        shared = int(_require(raw, "shared_expert_intermediate_size", path)) if model_type == "qwen3_next" else 0
    else:  # Qwen3.5 MoE: every layer routed, weights renormalised, a gated shared expert
        if raw.get("mlp_only_layers"):
            raise ModelLoadError(where, "mlp_only_layers is not supported for qwen3_5_moe (every layer is routed)")
        dense, norm = (), True
        shared = int(_require(raw, "shared_expert_intermediate_size", path))
    experts = Experts(num_experts=num_experts,
                      top_k=int(_require(raw, "num_experts_per_tok", path)),
                      intermediate_size=int(_require(raw, "moe_intermediate_size", path)), norm_topk_prob=norm,
                      shared_intermediate_size=shared, dense_layers=dense)
    if not 0 < experts.top_k <= experts.num_experts:
        raise ModelLoadError(where, f"num_experts_per_tok {experts.top_k} is not in 1..num_experts "
                                    f"({experts.num_experts})")
    return experts


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
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))  # transformers' default
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
    theta, scaling = rope_settings(raw, str(path / "config.json"))
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
        intermediate_size=int(raw.get("intermediate_size") or 0) if model_type.startswith("qwen3_5_moe")
        or model_type == "qwen3_next" else int(_require(raw, "intermediate_size", path)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type != "qwen2" and attention_bias),
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or hybrid,
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=_eos_ids(raw, path),
        experts=_experts(raw, path, model_type, num_layers),
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
