"""Throwaway random-weight checkpoints (Llama / Qwen2 / Qwen3) with a small BPE tokenizer, for tests and demos."""

from __future__ import annotations

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

    from blockspec.common.models import parse_config, read_config
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
