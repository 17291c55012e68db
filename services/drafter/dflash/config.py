"""The DFlash / DFlash-2 drafter's config as z-lab publishes it, validated.

A drafter key is read from `dflash_config` first, then from the top level of config.json (the published DFlash
drafters keep `block_size` there), then takes the reference's default: block_size 16, target_layer_ids spread over
the target's layers (`default_target_layer_ids`). The DFlash-2 modules (`conv_kernel_size`: the two-tap dynamic
convolutions; `selector_rank`: the pairwise path selector) are present where their keys are, absent otherwise (plain
DFlash). A key this module does not know is refused, named: a setting silently ignored would give other drafts than
the reference's for the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.model_config import DEFAULTS, rope_settings

DEFAULT_BLOCK_SIZE = 16
DRAFTER_KEYS = ("target_layer_ids", "block_size", "mask_token_id", "conv_kernel_size", "conv_group_size",
                "selector_rank", "selector_top_k", "output_multiplier", "final_logit_softcapping",
                "input_embedding_scale", "short_blocks", "sampling_top_k", "last_tap_before_norm")
# Top-level keys read below, and those with no bearing on drafting (bookkeeping, the target's token ids, training).
MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "num_target_layers", "rms_norm_eps", "hidden_act", "rope_theta",
              "rope_parameters", "rope_scaling", "attention_bias", "layer_types", "sliding_window",
              "use_sliding_window", "max_window_layers", "is_causal", "mlp_bias", "dflash_config")
INERT_KEYS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache",
              "initializer_range", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
              "max_position_embeddings", "tie_word_embeddings", "auto_map", "_name_or_path", "blockspec_training")
ATTENTION_TYPES = ("full_attention", "sliding_attention")
QWEN3 = DEFAULTS["qwen3"]  # the reference's drafter is a Qwen3 model: transformers' Qwen3 defaults for absent keys


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """The reference's taps where a config names none: the middle layer for a one-layer drafter, else one per drafter
    layer spread evenly from layer 1 to layer num_target_layers - 3, rounded."""
    if num_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(round(first + i * (last - first) / (num_layers - 1)) for i in range(num_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # equals the target's: the drafter uses the target's embedding and LM head
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    num_target_layers: int  # layer count of the target the drafter was trained on
    # Tapped target layers, 0-based, read as the reference reads transformers' hidden_states[i + 1]: layer i's output,
    # and for the last layer the final norm's output. The features are concatenated in this order.
    target_layer_ids: tuple[int, ...]
    block_size: int  # anchor + block_size - 1 draft slots
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    conv_kernel_size: int | None = 2  # two-tap dynamic convolution; None = module absent
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int | None = 256  # pairwise path selector rank r; None = module absent
    selector_top_k: int = 16  # candidates per slot the selector walks over
    output_multiplier: float | None = None  # draft logits scale
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None  # the block's token embeddings scaled by this
    attention_bias: bool = False  # q, k, v and o projections with biases
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling parameters (common.model_config.rope_settings)
    # Per layer: full attention, or sliding-window attention seeing keys less than sliding_window positions away.
    layer_types: tuple[str, ...] = ()  # empty: all full attention
    sliding_window: int | None = None
    # is_causal: a block slot sees only the block's earlier slots (else the whole block); None, as the reference
    # reads an absent key: the sliding-window layers causal, the full-attention ones not.
    is_causal: bool | None = False
    # blockspec's own: a greedy proposal runs only the k + 1 block slots it needs, not block_size (cheaper, other
    # drafts than the reference's); set on the drafters blockspec trains, where it is measured.
    short_blocks: bool = False
    # blockspec's own: the candidates per slot a sampling request's walk draws from (its q's support), the selector's
    # top ones by unary score; None: selector_top_k. Greedy walks keep selector_top_k.
    sampling_top_k: int | None = None
    # blockspec's own: the last target layer is tapped before the final norm, not after it as the reference reads it;
    # set on the drafters trained so (the shipped ones), whose weights expect those features.
    last_tap_before_norm: bool = False

    @property
    def tap_points(self) -> tuple[int, ...]:
        """The verifier's tap ids (`runner.Runner`) for target_layer_ids, increasing and distinct: a layer's id for its
        output, num_target_layers for the final norm's output (the last layer as the reference reads it). The drafter
        reads its features in this order (`checkpoint.load_drafter` arranges `fc` for it)."""
        last = self.num_target_layers - 1
        return tuple(sorted({self.num_target_layers if i == last and not self.last_tap_before_norm else i
                             for i in self.target_layer_ids}))

    @property
    def sampling_width(self) -> int:
        """Candidates per slot of a walk that samples (never fewer than the greedy walk's)."""
        return max(self.sampling_top_k or 0, self.selector_top_k)

    @property
    def mlp_bias(self) -> bool:
        return False  # Qwen3-style MLP; lets common.decoder.MLP read this config

    @property
    def rope_dim(self) -> int:
        return self.head_dim  # RoPE over whole heads (rope_table)

    @property
    def max_k(self) -> int:
        return self.block_size - 1

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def layer_causal(self, layer: int) -> bool:
        return self.layer_type(layer) == "sliding_attention" if self.is_causal is None else self.is_causal

    @property
    def plain_attention(self) -> bool:
        """Every layer sees all of the context and the whole block, with no biases (what the C++ path computes)."""
        return not (self.attention_bias or self.layer_types or any(self.layer_causal(i) for i in range(self.num_layers)))

    def to_hf(self) -> dict:
        """config.json in the published layout (architectures DFlash2DraftModel, dflash_config)."""
        dflash = {
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "conv_group_size": self.conv_group_size,
            "selector_top_k": self.selector_top_k,
        }
        for key in ("conv_kernel_size", "selector_rank", "output_multiplier", "final_logit_softcapping",
                    "input_embedding_scale"):
            if getattr(self, key) is not None:
                dflash[key] = getattr(self, key)
        if self.short_blocks:
            dflash["short_blocks"] = True
        if self.sampling_top_k is not None:
            dflash["sampling_top_k"] = self.sampling_top_k
        if self.last_tap_before_norm:
            dflash["last_tap_before_norm"] = True
        rope = {"rope_theta": self.rope_theta, "rope_type": "llama3" if self.rope_scaling else "default",
                **dict(self.rope_scaling)}
        extra = {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window} if self.layer_types else {}
        return {
            "architectures": ["DFlash2DraftModel" if self.conv_kernel_size or self.selector_rank else "DFlashDraftModel"],
            "model_type": "qwen3",
            **({"is_causal": self.is_causal} if self.is_causal is not None else {}),
            "attention_bias": self.attention_bias,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "num_target_layers": self.num_target_layers,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "rope_parameters": rope,
            **extra,
            "dflash_config": dflash,
        }

    @classmethod
    def from_hf(cls, raw: dict, path: str) -> DFlashConfig:
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict) or not (dflash or "block_size" in raw):
            raise ModelLoadError(path, "config.json has neither dflash_config nor block_size: not a DFlash drafter checkpoint")
        unknown = sorted(set(dflash) - set(DRAFTER_KEYS))
        unknown += sorted(set(raw) - set(DRAFTER_KEYS) - set(MODEL_KEYS) - set(INERT_KEYS))
        if unknown:
            raise ModelLoadError(path, f"unsupported drafter config key(s) {', '.join(unknown)} (blockspec implements "
                                       f"{', '.join(DRAFTER_KEYS + MODEL_KEYS[:-1])})")

        def value(key: str, default: object = None) -> object:  # dflash_config, then the top level, then default
            return dflash.get(key, raw.get(key, default))

        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "num_target_layers") if k not in raw]
        missing += [] if value("mask_token_id") is not None else ["mask_token_id"]
        if missing:
            raise ModelLoadError(path, f"DFlash config misses key(s) {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(path, f"hidden_act {raw['hidden_act']!r} is not supported; expected 'silu'")
        if raw.get("mlp_bias"):
            raise ModelLoadError(path, "mlp_bias=true is not supported (the drafter's MLP has no biases)")
        theta, scaling = rope_settings(raw, path)
        heads, layers = int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
        layer_types, window = cls._attention_layout(raw, layers, path)
        taps = value("target_layer_ids")
        cfg = cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or QWEN3["num_key_value_heads"]),
            head_dim=int(raw.get("head_dim") or QWEN3["head_dim"]),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            target_layer_ids=(tuple(int(i) for i in taps) if taps is not None
                              else default_target_layer_ids(int(raw["num_target_layers"]), layers)),
            block_size=int(value("block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=int(value("mask_token_id")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            conv_kernel_size=value("conv_kernel_size"),
            conv_group_size=int(value("conv_group_size", 16)),
            selector_rank=value("selector_rank"),
            selector_top_k=int(value("selector_top_k", 16)),
            output_multiplier=value("output_multiplier"),
            final_logit_softcapping=value("final_logit_softcapping"),
            input_embedding_scale=value("input_embedding_scale"),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=layer_types,
            sliding_window=window,
            is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
            short_blocks=bool(value("short_blocks", False)),
            sampling_top_k=None if value("sampling_top_k") is None else int(value("sampling_top_k")),
            last_tap_before_norm=bool(value("last_tap_before_norm", False)),
        )
        if cfg.sampling_top_k is not None and not cfg.selector_top_k <= cfg.sampling_top_k <= cfg.vocab_size:
            raise ModelLoadError(path, f"sampling_top_k {cfg.sampling_top_k} must lie between selector_top_k "
                                       f"{cfg.selector_top_k} and vocab_size {cfg.vocab_size}")
        if cfg.block_size < 2:
            raise ModelLoadError(path, f"block_size {cfg.block_size} must be at least 2")
        if cfg.conv_kernel_size is not None and cfg.hidden_size % cfg.conv_group_size:
            raise ModelLoadError(path, f"hidden_size {cfg.hidden_size} is not a multiple of conv_group_size {cfg.conv_group_size}")
        return cfg

    @staticmethod
    def _attention_layout(raw: dict, layers: int, path: str) -> tuple[tuple[str, ...], int | None]:
        """layer_types and sliding_window: as given, or derived as transformers' Qwen3 config does (sliding layers
        from max_window_layers on, where use_sliding_window is set)."""
        window = raw.get("sliding_window") if raw.get("use_sliding_window", "layer_types" in raw) else None
        types = raw.get("layer_types")
        if types is None:
            start = int(raw.get("max_window_layers", layers))
            types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                     for i in range(layers)]
        unknown = sorted(set(types) - set(ATTENTION_TYPES))
        if unknown or len(types) != layers:
            raise ModelLoadError(path, f"layer_types: {len(types)} entries for {layers} layers"
                                       + (f", unsupported {unknown}" if unknown else "") + f"; known: {ATTENTION_TYPES}")
        if all(t == "full_attention" for t in types):
            return (), None
        return tuple(types), None if window is None else int(window)  # no window: sliding layers see all keys

