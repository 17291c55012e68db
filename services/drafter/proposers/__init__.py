"""The drafting methods by name, and the one place that builds a proposer for a method."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.common.contracts import Proposer
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import Checkpoint, check_same_tokenizer, load_checkpoint

METHODS = ("none", "ngram", "draft_model", "dflash")
METHODS_WITH_DRAFTER = ("draft_model", "dflash")
MAX_K = 16  # largest k the ngram and draft_model methods accept (dflash: its block_size - 1)


@dataclass(frozen=True)
class TargetView:
    """What a drafter may use of the target: shared tensors (never copies) and the tap features."""

    embedding: torch.Tensor  # [vocab, H]
    lm_head: torch.Tensor  # [vocab, H]
    features: object  # request id -> tap features [>= committed_len - 1, n_taps * H] (the first rows the request's)
    tap_buffer: torch.Tensor | None = None  # the whole buffer whose per-slot rows `features` gives (captured proposals)


def check_method(method: str, drafter: str | Path | None) -> None:
    """Refuse an unknown method, a drafter for a method that takes none, and a missing one."""
    if method not in METHODS:
        raise InvalidArgument("method", f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if drafter is not None and method not in METHODS_WITH_DRAFTER:
        raise InvalidArgument("drafter", f"method {method!r} takes no drafter; drafter methods: {', '.join(METHODS_WITH_DRAFTER)}")
    if drafter is None and method in METHODS_WITH_DRAFTER:
        raise InvalidArgument("drafter", f"method {method!r} needs a drafter checkpoint directory")


def verifier_needs(method: str, dflash_cfg=None) -> tuple[tuple[int, ...], int]:
    """What the verifier provides for a method: the target layers whose outputs the drafter reads (dflash's
    taps), and the most draft tokens one step verifies (invariant mode's query width is that + 1)."""
    if method == "dflash":
        return dflash_cfg.tap_points, dflash_cfg.max_k
    return (), 0 if method == "none" else MAX_K


def default_method(drafter: str | Path | None) -> str:
    """dflash for a DFlash checkpoint, draft_model for another drafter, ngram without one."""
    if drafter is None:
        return "ngram"
    from blockspec.services.drafter.dflash.checkpoint import is_dflash_checkpoint

    return "dflash" if is_dflash_checkpoint(drafter) else "draft_model"


def build_proposer(
    method: str,
    target: Checkpoint,
    drafter: str | Path | None,
    num_slots: int,
    max_len: int,
    target_view: TargetView | None = None,
    dflash_model: object | None = None,
    use_dynamic_conv: bool = True,
    use_path_selector: bool = True,
    device: torch.device | str = "cpu",  # draft_model: where its own target-shaped runner lives
    dtype: torch.dtype = torch.float32,
) -> Proposer:
    check_method(method, drafter)
    if method == "none":
        from blockspec.services.drafter.proposers.none import NoneProposer

        return NoneProposer()
    if method == "ngram":
        from blockspec.services.drafter.proposers.ngram import NgramProposer

        return NgramProposer(max_k=MAX_K)
    if method == "dflash":
        from blockspec.services.drafter.proposers.dflash import DFlashProposer

        v = target_view
        return DFlashProposer(dflash_model, v.embedding, v.lm_head, v.features, num_slots, max_len,
                              use_dynamic_conv, use_path_selector, v.tap_buffer)
    from blockspec.services.drafter.proposers.draft_model import DraftModelProposer

    draft = load_checkpoint(drafter)
    check_same_tokenizer(target, draft)
    return DraftModelProposer(draft, num_slots, max_len, max_k=MAX_K, device=device, dtype=dtype)
