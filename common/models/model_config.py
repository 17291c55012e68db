"""A target checkpoint's config.json read as transformers reads it: each family's keys with transformers' defaults where
a key is absent, a multimodal checkpoint's language model from `text_config`, and any key that is not read, checked
or known to have no bearing refused by name (`parse_config` -> `ModelConfig`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from blockspec.common.errors import ModelLoadError

# model_type -> family. The dense three differ only in biases and the q/k norm; the Qwen3.5 hybrids (text-only
# `qwen3_5_text`, multimodal `qwen3_5` whose text model is read and its vision tower left out) interleave Gated DeltaNet
# linear-attention layers with gated full-attention layers (`layer_types`).
# The MoE variants (`qwen3_moe`; `qwen3_5_moe` and its text-only `qwen3_5_moe_text`) replace the MLP with routed
# experts (and, in Qwen3.5, a gated shared expert). Qwen3-Next (`qwen3_next`) has the Qwen3.5 MoE's layers with the
# linear layers' q, k, v, z and b, a projections fused per key head (`models.unfuse_qwen3_next`).
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # their language model's config is `text_config`
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES
LAYER_TYPES = ("full_attention", "linear_attention")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# What transformers 5 takes for a key the config leaves out, per family: its config classes' field defaults (and
# their __post_init__: Qwen3.5's and Qwen3-Next's partial_rotary_factor and full_attention_interval). None: derived
# from other keys, as transformers derives it (key/value heads = attention heads; head_dim = hidden / heads).
# tests/common/models/test_conformance.py compares every entry with the installed transformers' classes.
_SHARED = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
           "max_position_embeddings": 32768, "head_dim": None}  # (Qwen2 has no attention_bias: see READ_KEYS)
_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": None}
_HYBRID = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "partial_rotary_factor": 0.25,
           "full_attention_interval": 4}
DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {**_SHARED, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "mlp_bias": False},
    "qwen2": {**{k: v for k, v in _SHARED.items() if k != "attention_bias"}, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32},
    "qwen3": {**_SHARED, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {**_SHARED, **_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False},
    "qwen3_next": {**_SHARED, **_MOE, **_HYBRID, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                   "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                   "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
                   "num_experts": 512, "norm_topk_prob": True},
    "qwen3_5_text": {**_SHARED, **_HYBRID, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_SHARED, **_HYBRID, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                         "num_attention_heads": 16, "num_key_value_heads": 2, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256},
}
DEFAULTS["qwen3_5"], DEFAULTS["qwen3_5_moe"] = DEFAULTS["qwen3_5_text"], DEFAULTS["qwen3_5_moe_text"]
# The transformers class each model_type's text config is (tests/common/models/test_conformance.py reads its defaults).
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
                  "qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5": "Qwen3_5TextConfig",
                  "qwen3_5_moe_text": "Qwen3_5MoeTextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}

# Keys with no bearing on the language model's next-token logits: bookkeeping, training-only settings, token ids
# (eos_token_id is read for stopping), and the published Qwen3.5 checkpoints' multi-token-prediction head (its tensors
# are left unread).
INERT_KEYS = frozenset((
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "initializer_range", "use_cache", "attention_dropout",
    "bos_token_id", "pad_token_id", "eos_token_id", "output_router_logits", "router_aux_loss_coef", "pretraining_tp",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"))
# Keys read (through DEFAULTS or below), per family; the rope keys are read by `rope_settings`.
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
# (Qwen2 has no attention_bias: its q, k and v projections always have biases, its o projection none.)
_READ_COMMON = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "hidden_act", *_ROPE_KEYS)
_SLIDING_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
_HYBRID_KEYS = ("layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "attn_output_gate",
                "output_gate_type", "mamba_ssm_dtype")
READ_KEYS: dict[str, frozenset[str]] = {
    "llama": frozenset((*_READ_COMMON, "attention_bias", "mlp_bias")),
    "qwen2": frozenset((*_READ_COMMON, *_SLIDING_KEYS)),
    "qwen3": frozenset((*_READ_COMMON, "attention_bias", *_SLIDING_KEYS)),
    "qwen3_moe": frozenset((*_READ_COMMON, "attention_bias", *_SLIDING_KEYS, *_MOE_KEYS)),
    "qwen3_next": frozenset((*_READ_COMMON, "attention_bias", *_MOE_KEYS, *_HYBRID_KEYS, "use_sliding_window")),
    "qwen3_5_text": frozenset((*_READ_COMMON, "attention_bias", *_HYBRID_KEYS)),
    "qwen3_5_moe_text": frozenset((*_READ_COMMON, "attention_bias", *_MOE_KEYS, *_HYBRID_KEYS)),
}
READ_KEYS["qwen3_5"], READ_KEYS["qwen3_5_moe"] = READ_KEYS["qwen3_5_text"], READ_KEYS["qwen3_5_moe_text"]
# The top level of a multimodal config: the language model's settings are in text_config; tie_word_embeddings is read
# here, as transformers' ...ForConditionalGeneration reads it; the vision tower's settings have no bearing on text.
MULTIMODAL_OUTER_KEYS = frozenset(("text_config", "tie_word_embeddings", "vision_config", "image_token_id",
                                   "video_token_id", "vision_start_token_id", "vision_end_token_id",
                                   "language_model_only")) | INERT_KEYS


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
    # Hybrid models (HYBRID_MODEL_TYPES, `common/models/hybrid.py`): each layer's type, the Gated DeltaNet dimensions and
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


def partial_rotary_factor(raw: dict, default: float) -> float:
    """The share of each head RoPE turns: `rope_parameters` first (transformers 5 moves it there), then the top level."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    return float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", default)))


def text_config(raw: dict, where: str) -> dict:
    """The language model's config. A multimodal Qwen3.5 checkpoint keeps it under `text_config`; its top level holds
    the vision tower's settings (no bearing on text) and `tie_word_embeddings`, which is read from there (default
    false) as transformers' ...ForConditionalGeneration reads it, whatever text_config says. Another top-level key is
    refused by name: its setting would be ignored."""
    if raw.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(where, f"a {raw['model_type']} config needs its language model's settings in text_config")
    stray = sorted(set(raw) - MULTIMODAL_OUTER_KEYS)
    if stray:
        raise ModelLoadError(where, f"key(s) {', '.join(stray)} at the top level of a multimodal config are not read "
                                    "(the language model's settings belong in text_config)")
    return {**text, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)), "model_type": raw["model_type"]}


class _Reader:
    """A config's keys with its family's defaults (DEFAULTS), each error naming the file."""

    def __init__(self, raw: dict, family: str, where: str) -> None:
        self.raw, self.defaults, self.where = raw, DEFAULTS[family], where

    def __call__(self, key: str) -> object:
        value = self.raw.get(key)
        return self.defaults.get(key) if value is None else value

    def int(self, key: str) -> int:
        value = self(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise ModelLoadError(self.where, f"{key} {value!r} is not an integer")
        return int(value)

    def refuse(self, message: str) -> None:
        raise ModelLoadError(self.where, message)


def _check_keys(raw: dict, family: str, where: str) -> None:
    """Refuse a key that is neither read for this family nor known to have no bearing (a quantization config, a
    sliding window on a family read without one, ...): a setting silently ignored would serve another model."""
    unknown = sorted(set(raw) - READ_KEYS[family] - INERT_KEYS - {"text_config"})
    if unknown:
        raise ModelLoadError(where, f"config key(s) {', '.join(unknown)} are not supported for {family} (blockspec "
                                    "reads the keys docs/models.md lists; an ignored setting would change the model)")


def _attention_layout(read: _Reader, family: str, num_layers: int) -> None:
    """A dense family's layers are all full attention: refuse a sliding window (use_sliding_window, or
    sliding_attention in layer_types, which transformers' Qwen2 / Qwen3 honour)."""
    if read.raw.get("use_sliding_window"):
        read.refuse("use_sliding_window=true is not supported")
    types = read.raw.get("layer_types")
    if family in DENSE_MODEL_TYPES and types is not None:
        if len(types) != num_layers or set(types) - {"full_attention"}:
            read.refuse(f"layer_types {sorted(set(types))} over {len(types)} entries: only full_attention over "
                        f"{num_layers} layers is supported")
    rotary = partial_rotary_factor(read.raw, 1.0)
    if family in DENSE_MODEL_TYPES and rotary != 1.0:
        read.refuse(f"partial_rotary_factor {rotary} is not supported for {family} (RoPE over whole heads)")


def _experts(read: _Reader, family: str, num_layers: int) -> Experts | None:
    """The MoE fields of a qwen3_moe / qwen3_5_moe / qwen3_next config (None for the others)."""
    if family not in MOE_MODEL_TYPES:
        return None
    raw = read.raw
    if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:  # the name some tools save
        read = _Reader({**raw, "num_experts": raw["num_local_experts"]}, family, read.where)
    num_experts = read.int("num_experts")
    shared = read.int("shared_expert_intermediate_size") if family != "qwen3_moe" else 0
    if family in ("qwen3_moe", "qwen3_next"):  # routed where decoder_sparse_step / mlp_only_layers say
        step, only = read.int("decoder_sparse_step"), set(read("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only or num_experts == 0 or (i + 1) % step)
        norm = bool(read("norm_topk_prob"))
    else:  # Qwen3.5 MoE: every layer routed, the top-k weights always renormalised (transformers reads neither key)
        if raw.get("mlp_only_layers"):
            read.refuse("mlp_only_layers is not supported for qwen3_5_moe (every layer is routed)")
        if raw.get("norm_topk_prob") is False:
            read.refuse("norm_topk_prob=false is not supported for qwen3_5_moe (its router always renormalises)")
        if raw.get("decoder_sparse_step", 1) != 1:
            read.refuse("decoder_sparse_step other than 1 is not supported for qwen3_5_moe (every layer is routed)")
        dense, norm = (), True
    experts = Experts(num_experts=num_experts, top_k=read.int("num_experts_per_tok"),
                      intermediate_size=read.int("moe_intermediate_size"), norm_topk_prob=norm,
                      shared_intermediate_size=shared, dense_layers=dense)
    if not 0 < experts.top_k <= experts.num_experts:
        read.refuse(f"num_experts_per_tok {experts.top_k} is not in 1..num_experts ({experts.num_experts})")
    return experts


def _hybrid_fields(read: _Reader, num_layers: int, head_dim: int) -> dict:
    """The ModelConfig fields of a Qwen3.5 hybrid: layer types (or the interval they follow), the Gated DeltaNet
    dimensions, partial RoPE, the output gate."""
    raw = read.raw
    types = raw.get("layer_types")
    if types is None:
        interval = read.int("full_attention_interval")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != num_layers:
        read.refuse(f"layer_types: {len(types)} entries for {num_layers} layers"
                    + (f", unknown types {unknown}" if unknown else "") + f"; known: {LAYER_TYPES}")
    for key, value in (("attn_output_gate", True), ("output_gate_type", "swish"), ("mamba_ssm_dtype", "float32")):
        if raw.get(key, value) != value:  # what transformers' Qwen3.5 computes, whatever the key says
            read.refuse(f"{key}={raw[key]!r} is not supported (the model runs with {key}={value!r})")
    linear = LinearAttention(
        num_k_heads=read.int("linear_num_key_heads"), num_v_heads=read.int("linear_num_value_heads"),
        k_head_dim=read.int("linear_key_head_dim"), v_head_dim=read.int("linear_value_head_dim"),
        conv_kernel=read.int("linear_conv_kernel_dim"))
    if linear.num_v_heads % linear.num_k_heads:
        read.refuse(f"linear_num_value_heads {linear.num_v_heads} is not a multiple of linear_num_key_heads "
                    f"{linear.num_k_heads}")
    rotary = partial_rotary_factor(raw, read.defaults["partial_rotary_factor"])
    return {"layer_types": tuple(types), "linear": linear, "rotary_dim": int(head_dim * rotary)}


def parse_config(raw: dict, path: Path) -> ModelConfig:
    """Validate the HF config dict of the checkpoint directory `path` for one of the supported families and turn it into
    a ModelConfig."""
    where = str(path / "config.json")
    raw = text_config(raw, where)
    family = raw.get("model_type")
    if family not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(str(path), f"unsupported architecture (model_type={family!r}, "
                                        f"architectures={raw.get('architectures')}); expected one of model_type "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    _check_keys(raw, family, where)
    read = _Reader(raw, family, where)
    if read("hidden_act") != "silu":
        read.refuse(f"hidden_act {read('hidden_act')!r} is not supported; supported: 'silu'")
    hidden, heads, num_layers = read.int("hidden_size"), read.int("num_attention_heads"), read.int("num_hidden_layers")
    head_dim = read.int("head_dim") if read("head_dim") is not None else hidden // heads
    _attention_layout(read, family, num_layers)
    theta, scaling = rope_settings(raw, where)
    attention_bias = bool(read("attention_bias"))
    hybrid = family in HYBRID_MODEL_TYPES
    if hybrid and attention_bias:
        read.refuse("attention_bias=true is not supported for a hybrid model")
    eos = generation_eos(path) or _eos(raw.get("eos_token_id"))
    return ModelConfig(
        family=family,
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=read.int("intermediate_size") if "intermediate_size" in read.defaults else 0,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=read.int("num_key_value_heads") if read("num_key_value_heads") is not None else heads,
        head_dim=head_dim,
        rms_norm_eps=float(read("rms_norm_eps")),
        max_position_embeddings=read.int("max_position_embeddings"),
        tie_word_embeddings=bool(read("tie_word_embeddings")),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=family == "llama" and bool(read("mlp_bias")),
        qk_norm=family in ("qwen3", "qwen3_moe") or hybrid,
        rope_theta=theta,
        rope_scaling=scaling,
        eos_token_ids=eos,
        experts=_experts(read, family, num_layers),
        **(_hybrid_fields(read, num_layers, head_dim) if hybrid else {}),
    )


def generation_eos(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of the directory's generation_config.json, where it names them: they override the model
    config's, as transformers' generate reads them."""
    gen = path / "generation_config.json"
    return _eos(json.loads(gen.read_text()).get("eos_token_id")) if gen.is_file() else ()


def _eos(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
