"""The DFlash-2 drafter's config: the published `config.json` / `dflash_config` keys, validated."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from blockspec.common.errors import ModelLoadError


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
    target_layer_ids: tuple[int, ...]  # tapped target layers (decoder layer outputs, 0-based)
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

    @property
    def mlp_bias(self) -> bool:
        return False  # Qwen3-style MLP; lets common.decoder.MLP read this config

    @property
    def rope_scaling(self) -> tuple:
        return ()  # plain RoPE; lets common.decoder.rope_table read this config

    @property
    def rope_dim(self) -> int:
        return self.head_dim  # RoPE over whole heads (rope_table)

    @property
    def max_k(self) -> int:
        return self.block_size - 1

    def to_hf(self) -> dict:
        """config.json in the published layout (architectures DFlash2DraftModel, dflash_config)."""
        dflash = {
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "conv_group_size": self.conv_group_size,
            "selector_top_k": self.selector_top_k,
        }
        for key in ("conv_kernel_size", "selector_rank", "output_multiplier", "final_logit_softcapping"):
            if getattr(self, key) is not None:
                dflash[key] = getattr(self, key)
        return {
            "architectures": ["DFlash2DraftModel"],
            "model_type": "qwen3",
            "is_causal": False,
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
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "dflash_config": dflash,
        }

    @classmethod
    def from_hf(cls, raw: dict, path: str) -> DFlashConfig:
        dflash = raw.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ModelLoadError(path, "config.json has no dflash_config: not a DFlash drafter checkpoint")
        missing = [k for k in ("target_layer_ids", "block_size", "mask_token_id") if k not in dflash]
        missing += [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "vocab_size", "num_target_layers") if k not in raw]
        if missing:
            raise ModelLoadError(path, f"DFlash config misses key(s) {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(path, f"hidden_act {raw['hidden_act']!r} is not supported; expected 'silu'")
        rope = raw.get("rope_parameters") or {}
        heads = int(raw["num_attention_heads"])
        cfg = cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            block_size=int(dflash["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            conv_kernel_size=dflash.get("conv_kernel_size"),
            conv_group_size=int(dflash.get("conv_group_size", 16)),
            selector_rank=dflash.get("selector_rank"),
            selector_top_k=int(dflash.get("selector_top_k", 16)),
            output_multiplier=dflash.get("output_multiplier"),
            final_logit_softcapping=dflash.get("final_logit_softcapping"),
        )
        if cfg.block_size < 2:
            raise ModelLoadError(path, f"block_size {cfg.block_size} must be at least 2")
        if cfg.conv_kernel_size is not None and cfg.hidden_size % cfg.conv_group_size:
            raise ModelLoadError(path, f"hidden_size {cfg.hidden_size} is not a multiple of conv_group_size {cfg.conv_group_size}")
        return cfg

    def as_dict(self) -> dict:
        return asdict(self)
