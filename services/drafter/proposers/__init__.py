"""The drafting methods by name, and the one place that builds a proposer for a method."""

from __future__ import annotations

from pathlib import Path

from blockspec.common.errors import InvalidArgument
from blockspec.common.models import Checkpoint, check_same_tokenizer, load_checkpoint
from blockspec.services.drafter.proposer import Proposer

METHODS = ("none", "ngram", "draft_model")
METHODS_WITH_DRAFTER = ("draft_model",)
MAX_K = 16  # largest k the ngram and draft_model methods accept


def check_method(method: str, drafter: str | Path | None) -> None:
    """Refuse an unknown method, a drafter for a method that takes none, and a missing one."""
    if method not in METHODS:
        raise InvalidArgument("method", f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if drafter is not None and method not in METHODS_WITH_DRAFTER:
        raise InvalidArgument("drafter", f"method {method!r} takes no drafter; drafter methods: {', '.join(METHODS_WITH_DRAFTER)}")
    if drafter is None and method in METHODS_WITH_DRAFTER:
        raise InvalidArgument("drafter", f"method {method!r} needs a drafter checkpoint directory")


def build_proposer(
    method: str, target: Checkpoint, drafter: str | Path | None, num_slots: int, max_len: int | None
) -> Proposer:
    check_method(method, drafter)
    if method == "none":
        from blockspec.services.drafter.proposers.none import NoneProposer

        return NoneProposer()
    if method == "ngram":
        from blockspec.services.drafter.proposers.ngram import NgramProposer

        return NgramProposer(max_k=MAX_K)
    from blockspec.services.drafter.proposers.draft_model import DraftModelProposer

    draft = load_checkpoint(drafter)
    check_same_tokenizer(target, draft)
    return DraftModelProposer(draft, num_slots, max_len, max_k=MAX_K)
