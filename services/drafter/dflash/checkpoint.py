"""DFlash drafter checkpoints: an HF-style directory (config.json with dflash_config, safetensors)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.checkpoint import load_weights, read_config
from blockspec.common.models.model_config import ModelConfig
from blockspec.services.drafter.dflash import draft_vocab
from blockspec.services.drafter.dflash.config import DFlashConfig
from blockspec.services.drafter.dflash.model import DFlashDrafter


def is_dflash_checkpoint(path: str | Path) -> bool:
    return "dflash_config" in read_config(path)


def save_drafter(model: DFlashDrafter, out: str | Path, extra: dict | None = None) -> Path:
    """Write config.json (published layout, plus `extra` keys) and model.safetensors."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**model.cfg.to_hf(), **(extra or {})}, indent=2))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Build the drafter from a checkpoint directory; weight names as published (`model.` prefix tolerated).
    Its draft vocabulary (draft_vocab.py), where the directory ships one, is `model.draft_vocab`."""
    p = Path(path)
    cfg = DFlashConfig.from_hf(read_config(p), str(p))
    model = DFlashDrafter(cfg)
    weights = {k.removeprefix("model."): v for k, v in load_weights(p).items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(str(p), f"drafter weights do not fit its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ModelLoadError(str(p), f"tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(param.shape)}")
    cfg, weights = in_tap_order(cfg, weights)
    if cfg is not model.cfg:
        model = DFlashDrafter(cfg)
    model.load_state_dict(weights, strict=True)
    model.draft_vocab = draft_vocab.load(p, cfg.vocab_size)
    return model.to(dtype).eval().requires_grad_(False)


def in_tap_order(cfg: DFlashConfig, weights: dict[str, torch.Tensor]) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """The reference concatenates the tapped layers' outputs in the order target_layer_ids lists them (a layer listed
    twice, twice); the verifier keeps each tapped layer once, in increasing order (`DFlashConfig.tap_points`). For ids
    listed otherwise, fc's input columns are rearranged to that order, a repeated layer's columns summed: the same
    product over the verifier's features."""
    ids, order = cfg.target_layer_ids, tuple(sorted(set(cfg.target_layer_ids)))
    if ids == order:
        return cfg, weights
    H, fc = cfg.hidden_size, weights["fc.weight"]  # [H, len(ids) * H]
    blocks = [sum(fc[:, j * H : (j + 1) * H] for j, i in enumerate(ids) if i == layer) for layer in order]
    return dataclasses.replace(cfg, target_layer_ids=order), {**weights, "fc.weight": torch.cat(blocks, dim=1)}


def check_fits_target(cfg: DFlashConfig, target: ModelConfig, path: str) -> None:
    """Refuse a drafter built for another target, naming the mismatch."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} (drafter) vs {target.hidden_size} (target)")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} (drafter) vs {target.vocab_size} (target)")
    if cfg.num_target_layers != target.num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} (drafter) vs {target.num_layers} target layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary of {target.vocab_size}")
    if problems:  # named against the drafter's config.json, whose keys they are
        raise ModelLoadError(str(Path(path) / "config.json"), "drafter does not fit the target: " + "; ".join(problems))
