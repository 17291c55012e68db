"""Throwaway random-weight checkpoints (Llama / Qwen2 / Qwen3, Qwen3.5 hybrids) with a small BPE tokenizer, for tests
and demos."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

TINY_VOCAB = 320
SPECIALS = ("<|endoftext|>", "<|mask|>")


def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> object:
    """A byte-level BPE trained on two stdlib modules (deterministic, well under a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0], mask_token=SPECIALS[1]
    )


def build_tiny_checkpoint(
    out: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_position_embeddings: int = 512,
    tokenizer: object | None = None,
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
) -> Path:
    """Save a random-init causal LM of `family` with its tokenizer to `out` (HF layout) and return the path."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    tokenizer = tokenizer or tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(SPECIALS[0])
    config = config_cls(
        vocab_size=vocab_size or len(tokenizer),  # larger: rows no token maps to (memory tests)
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        # Untied by default: a random model with tied embeddings just repeats its input token.
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=eos,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_drafter(
    out: str | Path,
    target_dir: str | Path,
    seed: int = 0,
    block_size: int = 8,
    num_layers: int = 1,
    target_layer_ids: tuple[int, ...] | None = None,
    selector_rank: int | None = 16,
    conv_kernel_size: int | None = 2,
) -> Path:
    """A random-weight DFlash-2 drafter for the target in `target_dir` (published layout), every module
    perturbed away from its identity initialisation so that each code path does real work."""
    from transformers import AutoTokenizer

    from blockspec.common.models.checkpoint import read_config
    from blockspec.common.models.model_config import parse_config
    from blockspec.services.drafter.dflash.checkpoint import save_drafter
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.dflash.model import DFlashDrafter

    target = parse_config(read_config(target_dir), Path(target_dir))
    mask_id = AutoTokenizer.from_pretrained(str(target_dir)).mask_token_id
    taps = target_layer_ids or tuple(sorted({0, target.num_layers - 1}))
    cfg = DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=target.hidden_size * 2, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=target.hidden_size // 4, vocab_size=target.vocab_size,
        num_target_layers=target.num_layers, target_layer_ids=taps, block_size=block_size, mask_token_id=mask_id,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, conv_kernel_size=conv_kernel_size,
        conv_group_size=16, selector_rank=selector_rank, selector_top_k=8,
    )
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "codebook" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return save_drafter(model, out)


# The language models of the published checkpoints the tiny ones shrink (their config.json, or text_config):
# Qwen3.5-27B (hybrid), Qwen3.6-35B-A3B (hybrid MoE, the layout of Qwen3.5-35B-A3B), Qwen3-30B-A3B (MoE) and
# Qwen3-Next-80B-A3B (hybrid MoE, fused linear-layer projections).
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}
QWEN3_5_27B = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attn_output_gate": True, "attention_bias": False, "tie_word_embeddings": False,
    "rope_parameters": _QWEN3_5_ROPE,
}
QWEN3_6_35B_A3B = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attn_output_gate": True, "attention_bias": False, "tie_word_embeddings": False,
    "rope_parameters": _QWEN3_5_ROPE,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
QWEN3_NEXT_80B_A3B = {
    "model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
PUBLISHED = {"qwen3_5": QWEN3_5_27B, "qwen3_5_moe": QWEN3_6_35B_A3B, "qwen3_moe": QWEN3_30B_A3B,
             "qwen3_next": QWEN3_NEXT_80B_A3B}


def tiny_family_config(family: str, tokenizer: object, num_layers: int = 4, hidden_size: int = 64,
                       **overrides: object) -> dict:
    """PUBLISHED[family] shrunk: layers, widths, head dimensions and experts cut; its layer-type pattern (three linear
    layers, then full attention), its head ratios (e.g. 24 query to 4 KV heads becomes 6:1, 16 key to 48 value
    heads 1:3), partial RoPE and routing (top-k of the experts, shared expert) kept."""
    real = PUBLISHED[family]
    eos = tokenizer.convert_tokens_to_ids(SPECIALS[0])
    q_per_kv = real["num_attention_heads"] // real["num_key_value_heads"]
    cfg = {**real, "vocab_size": len(tokenizer), "hidden_size": hidden_size, "num_hidden_layers": num_layers,
           "num_attention_heads": q_per_kv, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512,
           "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": eos}
    if "intermediate_size" in real:
        cfg["intermediate_size"] = 2 * hidden_size
    if "linear_num_key_heads" in real:
        v_per_k = real["linear_num_value_heads"] // real["linear_num_key_heads"]
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=2 * v_per_k, linear_key_head_dim=16,
                   linear_value_head_dim=16)
    if "num_experts" in real:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        if "shared_expert_intermediate_size" in real:
            cfg["shared_expert_intermediate_size"] = 48
    cfg["rope_parameters"] = {**real["rope_parameters"], "rope_theta": 10000.0}
    if "mrope_section" in real["rope_parameters"]:
        cfg["rope_parameters"]["mrope_section"] = [2, 1, 1]
    return {**cfg, **overrides}


# transformers' classes per family: text config, causal LM, and (the Qwen3.5 families) the multimodal config and the
# conditional-generation model the published checkpoints are.
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", None, None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", None, None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", None, None),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", None, None),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", None, None),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeConfig",
                    "Qwen3_5MoeForConditionalGeneration"),
}


def build_family(out: str | Path, family: str, config: dict, layout: str = "text", seed: int = 0,
                 tokenizer: object | None = None, weight_scale: float = 1.0, lm_head_scale: float = 1.0,
                 outer: dict | None = None, drop_keys: tuple[str, ...] = (), drop_top_keys: tuple[str, ...] = ()
                 ) -> Path:
    """A random-weight checkpoint of `family` built by transformers' own classes from `config` (the language model's
    keys), saved as transformers saves it: layout "text" its causal LM (model.*), "multimodal" (the Qwen3.5 families)
    its conditional-generation model with a one-block vision tower and the top-level keys `outer` (the language model
    under model.language_model.*). Norms, biases, decays, step biases, experts and the router are drawn away from their
    initial values so that every term of the arithmetic shows; then every weight of two or more dimensions is scaled by
    weight_scale (sharper logits: no near-ties) and the LM head by lm_head_scale. drop_keys (the language model's) and
    drop_top_keys (a multimodal config's top level) are removed from the saved config.json: read as absent."""
    import transformers as tf

    text_cfg, text_model, mm_cfg, mm_model = (getattr(tf, c) if c else None for c in FAMILY_CLASSES[family])
    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    if layout == "text":
        model = text_model(text_cfg(**config))
    elif layout == "multimodal" and mm_model is not None:
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                  "out_hidden_size": config["hidden_size"], "num_position_embeddings": 16}
        model = mm_model(mm_cfg(text_config=config, vision_config=vision, **{"tie_word_embeddings": False,
                                                                             **(outer or {})}))
    else:
        raise ValueError(f"layout {layout!r} for {family}: expected 'text'" + (" or 'multimodal'" if mm_model else ""))
    _perturb(model, weight_scale, lm_head_scale)
    out = Path(out)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    if drop_keys or drop_top_keys:
        raw = json.loads((out / "config.json").read_text())
        for level, keys in ((raw.get("text_config", raw), drop_keys), (raw, drop_top_keys)):
            for key in keys:
                level.pop(key, None)
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@torch.no_grad()
def _perturb(model: torch.nn.Module, weight_scale: float, lm_head_scale: float) -> None:
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # a tied weight, once
            continue
        seen.add(id(p))
        if name.endswith(("norm.weight", "dt_bias")):
            p.add_(torch.randn_like(p) * 0.3)
        elif name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(-2.0, 1.0))
        elif "experts" in name or "shared_expert" in name:
            p.normal_(0.0, 0.05)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.1)
        if p.dim() >= 2 and weight_scale != 1.0:
            p.mul_(weight_scale)
        if name == "lm_head.weight":
            p.mul_(lm_head_scale)


def build_tiny_family(out: str | Path, family: str = "qwen3_5", layout: str = "text", seed: int = 0,
                      tokenizer: object | None = None, lm_head_scale: float = 1.0, **config: object) -> Path:
    """A random-weight checkpoint of a published family (tiny_family_config, `config` overriding its keys) built and
    saved by `build_family`; lm_head_scale > 1 sharpens the next-token distributions (a sampling test needs more than
    a near-uniform target)."""
    tokenizer = tokenizer or tiny_tokenizer()
    return build_family(out, family, tiny_family_config(family, tokenizer, **config), layout, seed, tokenizer,
                        lm_head_scale=lm_head_scale)
