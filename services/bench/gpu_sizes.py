"""The model sizes `blockspec gpu-check` measures (Qwen3-shaped targets up to ~27B, the Qwen3.5 hybrids) and their
random-weight targets and DFlash drafters, made on the device; whether a size fits the device's free memory."""

from __future__ import annotations

from pathlib import Path

import torch

from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.model_config import parse_config

# name -> (layers, hidden, heads, kv heads, intermediate, vocab), untied LM head: 0.75B, 8.2B and 26.7B
# parameters. "27b" has the reference target's size (~54 GB bf16); its drafter 2.2B.
SIZES = {
    "tiny": (2, 64, 4, 2, 128, 512),
    "1b": (28, 1024, 16, 8, 3072, 151936),
    "8b": (36, 4096, 32, 8, 12288, 151936),
    "27b": (64, 5120, 40, 8, 21504, 151936),
}
# Qwen3.5 hybrids: the published Qwen3.5-27B language model (26.9B parameters, 48 Gated DeltaNet and 16 attention
# layers), and the same shrunk (services/training/tiny.py).
HYBRID_SIZES = ("tiny-hybrid", "27b-hybrid")
SIZES = {**SIZES, **{size: None for size in HYBRID_SIZES}}
DRAFTER_LAYERS = {"tiny": 1, "1b": 1, "8b": 3, "27b": 5, "tiny-hybrid": 1, "27b-hybrid": 5}


def hf_config(size: str) -> dict:
    """The size's config.json as transformers writes it for Qwen3 (a hybrid size: Qwen3.5's), also what a
    transformers peer is built from."""
    if size in HYBRID_SIZES:
        from blockspec.services.training.tiny import QWEN3_5_27B, tiny_family_config, tiny_tokenizer

        cfg = QWEN3_5_27B if size == "27b-hybrid" else tiny_family_config("qwen3_5", tiny_tokenizer())
        return {**cfg, "max_position_embeddings": 4096, "eos_token_id": cfg["vocab_size"] - 1}
    layers, hidden, heads, kv, inter, vocab = SIZES[size]
    return {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 128 if hidden >= 1024 else 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "eos_token_id": vocab - 1}


def random_target(size: str, device: str, dtype: torch.dtype, layers: int | None = None) -> Checkpoint:
    """A checkpoint of the size's shape with random weights made directly on the device (no file, no host copy).
    layers: its first `layers` layers only (a hybrid keeps its pattern of layer types)."""
    from blockspec.common.runtime.runner import decoder_class

    raw = hf_config(size)
    cfg = parse_config({**raw, "num_hidden_layers": layers or raw["num_hidden_layers"]}, Path(f"<random {size}>"))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in decoder_class(cfg)(cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    # Norms at their identity: weight 1, or 0 where a hybrid's norm scales by 1 + weight.
    identity = {k: 0.0 if cfg.hybrid and not k.endswith("linear_attn.norm.weight") else 1.0 for k in shapes
                if k.endswith("norm.weight")}
    weights = {k: (torch.full(s, identity[k], dtype=dtype, device=device) if k in identity else
                   torch.randn(s, dtype=dtype, device=device, generator=gen) * 0.02) for k, s in shapes.items()}
    return Checkpoint(path=Path(f"<random {size}>"), config=cfg, weights=weights, tokenizer=None)


def weights_bytes(size: str, dtype: torch.dtype) -> int:
    """The bytes of the size's target and drafter weights in dtype (counted on the meta device: nothing allocated)."""
    from blockspec.common.runtime.footprint import parameters

    cfg = parse_config(hf_config(size), Path(f"<random {size}>"))
    params = parameters(cfg).total
    with torch.device("meta"):
        params += sum(p.numel() for p in random_drafter(size, cfg, "meta", dtype).parameters())
    return params * dtype.itemsize


def free_bytes(device: str) -> int:
    """Memory the device has free now: the GPU's (cudaMemGetInfo), or the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def check_fits(sizes: list[str], device: str, dtype: torch.dtype) -> None:
    """Refuse, naming --sizes, a size whose weights alone pass the device's free memory (each size is built after the
    last one is freed): `--device cpu` with the default sizes would build a 27B model in fp32 and be killed."""
    free = free_bytes(device)
    for size in sizes:
        need = weights_bytes(size, dtype)
        if need > free:
            fitting = [s for s in SIZES if weights_bytes(s, dtype) <= free]
            raise InvalidArgument("--sizes", f"{size} needs {need / 2**30:.1f} GiB for its weights in {dtype} on "
                                             f"{device}, which has {free / 2**30:.1f} GiB free: choose from "
                                             f"{', '.join(fitting) or 'none'}")


def random_drafter(size: str, cfg, device: str, dtype: torch.dtype):
    """A DFlash drafter shaped for the target (random weights), tapping its first, middle and last layer."""
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.dflash.model import DFlashDrafter

    taps = tuple(sorted({0, cfg.num_layers // 2, cfg.num_layers - 1}))
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=DRAFTER_LAYERS[size],
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                        num_target_layers=cfg.num_layers, target_layer_ids=taps, block_size=16,
                        mask_token_id=0, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, conv_kernel_size=2,
                        conv_group_size=16, selector_rank=8 if size.startswith("tiny") else 256, selector_top_k=16)
    return DFlashDrafter(dcfg).to(device, dtype).eval().requires_grad_(False)
